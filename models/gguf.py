"""Convert a GGUF Llama checkpoint (llama.cpp's format) into a Hugging Face model directory.

The output is what `transformers` and `specrun.models.loading` read: config.json,
model.safetensors (dequantized, HF key names, llama.cpp's q/k rotary interleave undone),
tokenizer.json (rebuilt from the vocabulary, merges and token types in the metadata),
tokenizer_config.json (special tokens, chat template) and generation_config.json.
Anything we cannot reproduce exactly (another architecture, an unknown pre-tokenizer, a quant
type the `gguf` package cannot dequantize) is refused with a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .config import LlamaConfig, RopeScaling
from .gguf_tokenizer import build_tokenizer, special_token_ids
from .llama import Llama, rope_inv_freq
from .loading import specs_of

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
_Q = gguf.GGMLQuantizationType
SUPPORTED_QUANT_TYPES = frozenset(
    {_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0}
    | {_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ4_NL, _Q.IQ4_XS}
)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_MAX_SHARD_BYTES = 4 << 30

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS_TENSOR = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFMetadata:
    """The key/value metadata of one GGUF file, with errors that name the file and key."""

    path: Path
    values: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise ValueError(
                f"{self.path.name} lacks the GGUF metadata field {key!r}; it is not a complete "
                "llama.cpp model file (re-export it with llama.cpp's convert_hf_to_gguf.py)"
            )
        return self.values[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))


def open_gguf(path: str | Path) -> tuple[gguf.GGUFReader, GGUFMetadata]:
    """Memory-map a GGUF file and read its metadata; refuse non-Llama files early."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no GGUF file at {path}; pass the path of a .gguf file")
    try:
        reader = gguf.GGUFReader(path)
        values = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.")
        }
    except Exception as e:  # the reader raises anything from struct errors to ValueError
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    meta = GGUFMetadata(path, values)
    if meta.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path.name} holds a {meta.architecture!r} model; specrun converts only "
            f"architectures {SUPPORTED_ARCHITECTURES}"
        )
    if meta.get("llama.expert_count", 0):
        raise ValueError(f"{path.name} is a mixture-of-experts Llama; specrun runs dense models")
    return reader, meta


def _float(value: float) -> float:
    """A float32 metadata value at its shortest float32 spelling (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def llama_config(
    meta: GGUFMetadata, *, vocab_size: int, tied: bool, rope_factors: np.ndarray | None = None
) -> LlamaConfig:
    """The LlamaConfig a GGUF's metadata describes.

    rope_factors: [head_dim // 2] float32 llama3 wavelength factors (the `rope_freqs` tensor).
    """
    arch = meta.architecture
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden_size = int(meta.require(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"{meta.path.name} rotates {rotary_dim} of {head_dim} head dimensions; specrun "
            "supports full-width rotary embeddings only"
        )
    special = special_token_ids(meta)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings=tied,
        bos_token_id=special.get("bos"),
        eos_token_ids=special_eos_ids(special),
    )
    if rope_factors is not None:
        config = _with_llama3_scaling(config, rope_factors, name=meta.path.name)
    return config


def special_eos_ids(special: dict[str, int]) -> tuple[int, ...]:
    """End-of-sequence ids: eos plus end-of-turn / end-of-message where the file has them."""
    ids = [special[k] for k in ("eos", "eot", "eom") if k in special]
    return tuple(dict.fromkeys(ids))


def _rope_scaling(meta: GGUFMetadata) -> RopeScaling:
    arch = meta.architecture
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(
            rope_type="linear", factor=_float(meta.require(f"{arch}.rope.scaling.factor"))
        )
    raise ValueError(
        f"{meta.path.name} uses rope scaling {kind!r}; specrun supports none/linear/llama3"
    )


def _with_llama3_scaling(config: LlamaConfig, factors: np.ndarray, *, name: str) -> LlamaConfig:
    """Recover llama3 rope-scaling parameters from llama.cpp's per-frequency factors.

    Only the ratios original_context / low_freq_factor and original_context / high_freq_factor
    are identifiable from the factors, so original_max_position_embeddings is fixed at 8192
    (Llama 3.x's) and the two frequency factors are solved for; the result is checked by
    recomputing the inverse frequencies.
    """
    factors = np.asarray(factors, dtype=np.float64)
    if factors.shape != (config.head_dim // 2,):
        raise ValueError(
            f"{name}: {ROPE_FREQS_TENSOR} has shape {factors.shape}; expected "
            f"({config.head_dim // 2},), one factor per rotary frequency"
        )
    if np.allclose(factors, 1.0):
        return config
    factor = float(factors.max())
    old_context = 8192
    base = config.rope_theta ** (-np.arange(0, config.head_dim, 2) / config.head_dim)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    between = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if between.sum() < 2:
        raise ValueError(f"{name}: cannot recover llama3 rope scaling from {ROPE_FREQS_TENSOR}")
    # smooth = old_context / wavelen / (high - low) - low / (high - low), linear in 1/wavelen.
    slope, intercept = np.polyfit(old_context * base[between] / (2 * np.pi), smooth[between], 1)
    low = -intercept / slope
    rope = RopeScaling(
        rope_type="llama3",
        factor=_float(factor),
        low_freq_factor=float(np.round(low, 6)),
        high_freq_factor=float(np.round(low + 1.0 / slope, 6)),
        original_max_position_embeddings=old_context,
    )
    scaled = dataclasses.replace(config, rope_scaling=rope)
    expected = torch.from_numpy(base / factors).float()
    if not torch.allclose(rope_inv_freq(scaled), expected, rtol=1e-4):
        raise ValueError(f"{name}: {ROPE_FREQS_TENSOR} does not follow llama3 rope scaling")
    return scaled


def hf_tensor_name(gguf_name: str) -> str:
    """transformers' key for a llama.cpp tensor name (`blk.3.attn_q.weight` -> ...q_proj.weight)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama checkpoint")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    weight: [num_heads * head_dim, ...]. llama.cpp interleaves each head's two rotary halves
    (rows j and j + head_dim/2 become neighbours) for its GPT-J-style rope; HF rotates halves.
    """
    rows = weight.shape[0]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def dequantize(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as float32, in torch's dimension order (GGUF lists dims reversed)."""
    if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
        raise ValueError(
            f"tensor {tensor.name} is stored as {tensor.tensor_type.name}; specrun dequantizes "
            f"{sorted(t.name for t in SUPPORTED_QUANT_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of every tensor a checkpoint of `config` holds (tied lm_head left out)."""
    with torch.device("meta"):
        model = Llama(config)
    shapes = {}
    for name, spec in specs_of(model).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head.") else f"model.{name}"
        shapes[key] = spec.shape
    return shapes


def hf_tensors(
    reader: gguf.GGUFReader, config: LlamaConfig, *, dtype: torch.dtype, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor in `dtype`) for every weight, shapes checked against `config`."""
    expected = expected_shapes(config)
    tensors = [t for t in reader.tensors if t.name != ROPE_FREQS_TENSOR]
    seen = set()
    for tensor in tqdm(tensors, desc="dequantizing", unit="tensor", disable=not progress):
        key = hf_tensor_name(tensor.name)
        value = dequantize(tensor)
        if key.endswith(("q_proj.weight", "q_proj.bias")):
            value = unpermute_rotary(value, config.num_heads)
        elif key.endswith(("k_proj.weight", "k_proj.bias")):
            value = unpermute_rotary(value, config.num_kv_heads)
        if expected.get(key) != tuple(value.shape):
            raise ValueError(
                f"tensor {tensor.name} has shape {tuple(value.shape)}; the metadata implies "
                f"{expected.get(key, 'no such tensor')} for {key}"
            )
        seen.add(key)
        yield key, value.to(dtype)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"the GGUF file lacks tensors for {missing[:5]} ({len(missing)} in all)")


def write_safetensors(
    tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, *, max_shard_bytes: int
) -> list[str]:
    """Save to model.safetensors, or HF-style shards plus an index past max_shard_bytes.

    Shards are written as they fill, so at most one shard is held in memory.
    """
    files: list[tuple[Path, list[str]]] = []
    total_bytes = 0
    for shard in _fill_shards(tensors, max_shard_bytes):
        path = out_dir / f".shard-{len(files):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        files.append((path, list(shard)))
        total_bytes += sum(_num_bytes(v) for v in shard.values())
    num_shards = len(files)
    if num_shards == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for (path, _), name in zip(files, names, strict=True):
        path.rename(out_dir / name)
    if num_shards > 1:
        weight_map = {
            key: name for (_, keys), name in zip(files, names, strict=True) for key in keys
        }
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _write_json(out_dir / "model.safetensors.index.json", index)
    return names


def _fill_shards(
    tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    for key, value in tensors:
        if shard and shard_bytes + _num_bytes(value) > max_shard_bytes:
            yield shard
            shard, shard_bytes = {}, 0
        shard[key] = value
        shard_bytes += _num_bytes(value)
    yield shard


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the HF directory for a GGUF Llama into `out_dir` (created; existing files replaced).

    dtype: storage dtype of the weights, float32 (default), bfloat16 or float16.
    """
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; use one of {OUTPUT_DTYPES}")
    reader, meta = open_gguf(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{meta.path.name} has no token_embd.weight tensor")
    rope_freqs = by_name.get(ROPE_FREQS_TENSOR)
    config = llama_config(
        meta,
        vocab_size=int(by_name["token_embd.weight"].shape[1]),
        tied="output.weight" not in by_name,
        rope_factors=None if rope_freqs is None else dequantize(rope_freqs).numpy(),
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s -> %s (%s)", meta.path, out_dir, dtype)
    _write_json(out_dir / "config.json", config.to_hf() | {"torch_dtype": _dtype_name(dtype)})
    num_tokens = len(meta.require("tokenizer.ggml.tokens"))
    if num_tokens > config.vocab_size:
        raise ValueError(
            f"{meta.path.name} lists {num_tokens} tokens but token_embd.weight has only "
            f"{config.vocab_size} rows"
        )
    tokenizer, tokenizer_config = build_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config(meta))
    tensors = hf_tensors(reader, config, dtype=dtype, progress=progress)
    write_safetensors(tensors, out_dir, max_shard_bytes=max_shard_bytes)
    return out_dir


def generation_config(meta: GGUFMetadata) -> dict[str, Any]:
    """generation_config.json: the special ids generation stops on / starts with."""
    special = special_token_ids(meta)
    eos = list(special_eos_ids(special))
    config: dict[str, Any] = {"bos_token_id": special.get("bos")}
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
    if "pad" in special:
        config["pad_token_id"] = special["pad"]
    return config


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
