"""Known models' shapes with random weights, for benchmarks that time a forward (its cost
does not depend on the weights' values): Llama-3.1-8B, Llama-3.1-70B and SmolLM2-135M
configs (`SHAPES`, with the draft vocabulary of an EAGLE-3 head for each), a target or a
tensor-parallel rank's shard of one built in place on its device (`random_target`), an
EAGLE-3-shaped head (`random_eagle3_head`), and the bytes a plain step reads.

A model is built on the meta device, given its dtype there and allocated on its device
parameter by parameter (`materialize_random`), so a rank of a 70B model never holds more
than its shard, never in float32 and never on the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..models.config import DraftConfig, LlamaConfig, RopeScaling
from ..models.eagle import DraftHead, build_draft
from ..models.llama import Llama
from ..models.tensor_parallel import Sharding, build_sharded_llama

# The rotary scaling of every Llama 3.1 model (config.json's rope_scaling).
LLAMA3_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

LLAMA_31_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=LLAMA3_ROPE,
    max_position_embeddings=131072,
)

LLAMA_31_70B = dataclasses.replace(
    LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64
)

SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class BenchShapes:
    """A target's shapes and the draft vocabulary of its EAGLE-3 head (whose layer has the
    target's shapes, as published EAGLE-3 heads for these models do)."""

    description: str
    target: LlamaConfig
    draft_vocab_size: int


SHAPES = {
    "llama-3.1-8b": BenchShapes("Llama-3.1-8B shapes", LLAMA_31_8B, 32000),
    "llama-3.1-70b": BenchShapes("Llama-3.1-70B shapes", LLAMA_31_70B, 32000),
    "smollm2-135m": BenchShapes("SmolLM2-135M shapes", SMOLLM2_135M, 8192),
}


def random_target(
    config: LlamaConfig,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    sharding: Sharding | None = None,
) -> Llama:
    """A Llama of `config`'s shapes with small random weights, built directly on `device` in
    `dtype`; with `sharding`, only that rank's tensor-parallel shard
    (models/tensor_parallel.py). Nothing is ever held at full size, in another dtype or on
    another device: the module is built on the meta device, given `dtype` there, and each
    parameter is allocated on `device` and filled in place (`materialize_random`)."""
    with torch.device("meta"):
        model = Llama(config) if sharding is None else build_sharded_llama(config, sharding)
    materialize_random(model, device=device, dtype=dtype)
    model.rotary.init_buffers(device)
    model.tie_weights()
    return model.eval()


def random_eagle3_head(
    target: Llama,
    *,
    draft_vocab_size: int,
    dtype: torch.dtype,
    layer: LlamaConfig | None = None,
) -> DraftHead:
    """An EAGLE-3 head (1 layer, `draft_vocab_size` outputs) with random weights, built
    directly on the target's device in `dtype`. `layer`: the shapes of its layer, by default
    the target's config; give a tensor-parallel shard's head the unsharded config (the head
    is replicated at full size, as a loaded one is)."""
    config = DraftConfig(
        kind="eagle3",
        layer=layer or target.config,
        target_hidden_size=target.config.hidden_size,
        draft_vocab_size=draft_vocab_size,
        tap_layers=target.tap_layers,
    )
    device = target.lm_head.weight.device
    with torch.device("meta"):
        head = build_draft(config, target)
    materialize_random(head, device=device, dtype=dtype)
    head.d2t.zero_()
    head.t2d.copy_(torch.arange(target.config.vocab_size, device=device) < draft_vocab_size)
    head.init_buffers(device)
    return head.eval()


def materialize_random(
    module: torch.nn.Module, *, device: str | torch.device, dtype: torch.dtype
) -> None:
    """Give a meta-device module storage on `device` in `dtype` (floating parameters and
    buffers; integer and boolean buffers keep theirs) and fill its parameters in place: norm
    weights with ones, the rest with N(0, 0.02). Buffers are left uninitialised."""
    module.to(dtype=dtype)  # still on meta: nothing is allocated
    module.to_empty(device=device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)


def weight_bytes(target: Llama) -> int:
    """Bytes of this rank's weights a plain step reads: every parameter but the input
    embedding (a lookup reads a row per token), the tied LM head counted once."""
    total = sum(
        p.numel() * p.element_size()
        for name, p in target.named_parameters()
        if not name.startswith("embed_tokens")
    )
    if target.config.tie_word_embeddings:
        total += target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    return total


def kv_bytes(target: Llama, *, batch: int, context: int) -> int:
    """Bytes of this rank's committed K/V a plain step reads: `batch` slots of `context`."""
    config = target.config
    element = target.lm_head.weight.element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element * batch * context
