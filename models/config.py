"""Model configurations: Llama targets and EAGLE draft heads, parsed from HF config.json.

Everything here is a frozen dataclass validated on construction; anything we cannot run
(another architecture, an unknown rope scaling type) fails with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_scaling`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                f"use one of {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor for llama3 scaling"
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None) -> RopeScaling:
        if not raw:
            return cls()
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        kwargs: dict[str, Any] = {"rope_type": rope_type}
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if name in raw:
                kwargs[name] = float(raw[name])
        if "original_max_position_embeddings" in raw:
            kwargs["original_max_position_embeddings"] = int(
                raw["original_max_position_embeddings"]
            )
        return cls(**kwargs)


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-architecture decoder (Llama 2, 3, 3.1, 3.2, SmolLM2, ...)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def default_tap_layers(self) -> tuple[int, int, int]:
        """EAGLE-3 taps: the inputs of layers 2, L//2 and L-3, clamped for shallow models."""
        last = self.num_layers
        return (min(2, last), last // 2, max(last - 3, 0))

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Parse a transformers LlamaConfig dict (config.json)."""
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported:
            raise ValueError(
                f"architectures={architectures} is not supported; specrun runs "
                f"{SUPPORTED_ARCHITECTURES}"
            )
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"model_type={model_type!r} is not supported; expected 'llama'")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; Llama uses 'silu'")
        return cls(**_common_fields(raw))

    @classmethod
    def from_json(cls, path: str | Path) -> LlamaConfig:
        return cls.from_hf(_read_json(path))

    def to_hf(self) -> dict[str, Any]:
        """The transformers config.json dict of this configuration."""
        rope = self.rope_scaling
        rope_scaling = None
        if rope.rope_type != "default":
            rope_scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
            if rope.rope_type == "llama3":
                rope_scaling |= {
                    "low_freq_factor": rope.low_freq_factor,
                    "high_freq_factor": rope.high_freq_factor,
                    "original_max_position_embeddings": rope.original_max_position_embeddings,
                }
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }


def _common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields shared by target configs and draft-head configs, with HF defaults."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [name for name in required if name not in raw]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {missing}")
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    # transformers >= 5 nests rope_theta and the scaling into `rope_parameters`.
    rope_parameters = raw.get("rope_parameters") or {}
    rope_raw = raw.get("rope_scaling") or (
        rope_parameters if rope_parameters.get("rope_type", "default") != "default" else None
    )
    rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": hidden_size,
        "intermediate_size": int(raw["intermediate_size"]),
        "num_layers": int(raw.get("num_hidden_layers", 1)),
        "num_heads": num_heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or num_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_scaling": RopeScaling.from_hf(rope_raw),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "attention_bias": bool(raw.get("attention_bias", False)),
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": eos_ids,
    }


DRAFT_KINDS = ("eagle1", "eagle3", "dense")


@dataclass(frozen=True)
class DraftConfig:
    """An EAGLE draft head.

    kind:
        "eagle1": EAGLE-1/2, fc over [embed, feature] + one decoder layer, target lm_head.
        "eagle3": EAGLE-3, fc over three target taps, one mid layer over
                  [norm(embed), norm(hidden)], own norm + lm_head over a draft vocabulary.
        "dense":  N decoder layers over fc([embed, feature]) with their own norm + lm_head
                  (the multi-layer drafter of arXiv 2508.08192).
    tap_layers: EAGLE-3 target taps in Llama's convention (tap i = the hidden state entering
        layer i). config.json's `eagle_aux_hidden_state_layer_ids` names layer *outputs*
        (SpecForge / sglang), i.e. these minus one; from_hf / to_hf convert.
    shared_lm_head: dense heads only: project with the target's lm_head instead of an own one
        (EAGLE-1 heads always use the target's, EAGLE-3 heads always own theirs).
    """

    kind: str
    layer: LlamaConfig
    num_layers: int = 1
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    tap_layers: tuple[int, ...] | None = None
    fc_bias: bool = False
    shared_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"draft kind {self.kind!r} is not supported; use one of {DRAFT_KINDS}")
        if self.shared_lm_head and self.kind != "dense":
            raise ValueError("shared_lm_head applies to dense heads only")
        if self.kind != "eagle3" and self.draft_vocab_size not in (None, self.layer.vocab_size):
            raise ValueError(f"draft_vocab_size applies to EAGLE-3 heads only, not {self.kind!r}")
        if self.num_layers < 1:
            raise ValueError(f"draft num_layers must be >= 1, got {self.num_layers}")
        if self.kind == "eagle3" and self.num_layers != 1:
            raise ValueError("EAGLE-3 heads have exactly one mid layer (num_hidden_layers=1)")
        if self.draft_vocab_size is not None and not (
            0 < self.draft_vocab_size <= self.layer.vocab_size
        ):
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in (0, vocab_size="
                f"{self.layer.vocab_size}]"
            )

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of one target hidden state fed to the head."""
        return self.target_hidden_size or self.layer.hidden_size

    @property
    def vocab_out(self) -> int:
        """Size of the head's output vocabulary (the draft vocabulary for EAGLE-3)."""
        return self.draft_vocab_size or self.layer.vocab_size

    @classmethod
    def from_hf(cls, raw: dict[str, Any], *, kind: str | None = None) -> DraftConfig:
        """Parse an EAGLE head's config.json (yuhuili EAGLE / EAGLE-3, SpecForge, dense)."""
        architectures = raw.get("architectures") or []
        kind = kind or raw.get("specrun_draft_kind") or _guess_kind(architectures, raw)
        eagle_config = raw.get("eagle_config") or {}
        fields = _common_fields(raw)
        if kind == "eagle3" and "rope_theta" not in raw and "rope_parameters" not in raw:
            fields["rope_theta"] = 10000.0
        fields["num_layers"] = 1
        taps = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        draft_vocab = raw.get("draft_vocab_size")
        return cls(
            kind=kind,
            layer=LlamaConfig(**fields),
            num_layers=int(raw.get("num_hidden_layers", 1)),
            target_hidden_size=raw.get("target_hidden_size"),
            draft_vocab_size=int(draft_vocab) if draft_vocab else None,
            tap_layers=tuple(int(t) + 1 for t in taps) if taps else None,
            fc_bias=bool(raw.get("bias", kind == "eagle1")),
            shared_lm_head=bool(raw.get("specrun_shared_lm_head", False)),
        )

    @classmethod
    def from_json(cls, path: str | Path, *, kind: str | None = None) -> DraftConfig:
        return cls.from_hf(_read_json(path), kind=kind)

    def to_hf(self) -> dict[str, Any]:
        raw = self.layer.to_hf()
        raw["architectures"] = [_ARCHITECTURE_OF_KIND[self.kind]]
        raw["specrun_draft_kind"] = self.kind
        raw["num_hidden_layers"] = self.num_layers
        raw["bias"] = self.fc_bias
        if self.target_hidden_size is not None:
            raw["target_hidden_size"] = self.target_hidden_size
        if self.draft_vocab_size is not None:
            raw["draft_vocab_size"] = self.draft_vocab_size
        if self.shared_lm_head:
            raw["specrun_shared_lm_head"] = True
        if self.tap_layers is not None:
            layer_outputs = [t - 1 for t in self.tap_layers]
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_outputs}
        return raw


_ARCHITECTURE_OF_KIND = {
    "eagle1": "LlamaForCausalLM",
    "eagle3": "LlamaForCausalLMEagle3",
    "dense": "SpecrunDenseDraft",
}


def _guess_kind(architectures: list[str], raw: dict[str, Any]) -> str:
    if any("Eagle3" in a or "EAGLE3" in a.upper() for a in architectures):
        return "eagle3"
    if "draft_vocab_size" in raw or "eagle_config" in raw:
        return "eagle3"
    if "SpecrunDenseDraft" in architectures:
        return "dense"
    return "eagle1"


def _read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {path}; point at a Hugging Face model directory")
    with path.open() as f:
        return json.load(f)
