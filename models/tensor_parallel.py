"""Tensor-parallel Llama layers (Megatron layout) over torch.distributed functional collectives.

A rank's model is the plain `Llama` of its local config (`local_config`: the attention heads,
KV heads and MLP width divided by the number of ranks), with four modules swapped
(`build_sharded_llama`):

- q/k/v and gate/up are column-parallel: each rank holds its block of each part's rows, so
  the fused projections stay fused and attention runs on the rank's own heads;
- the attention output and down projections are row-parallel (`RowParallelLinear`): each
  rank multiplies its block of columns and the partial sums are all-reduced;
- the embedding is split by vocabulary (`VocabParallelEmbedding`: ids outside the rank's
  range look up zeros, then an all-reduce), and so is the LM head (`VocabParallelLMHead`:
  the logits of every rank are gathered along the vocabulary, so sampling and tree building
  see the whole distribution on every rank).

The residual stream, norms and rotary tables are replicated, so every rank holds the same
hidden states (the EAGLE-3 taps included) and a replicated draft head sees the same features.
State-dict names and the checkpoint layout are the unsharded model's; `shard_slices` says
which block of each checkpoint tensor a rank reads (models/loading.py, `load_sharded_target`).

The collectives are `torch.distributed._functional_collectives`, which torch.compile traces
into the graph and CUDA graphs capture, and which run eagerly on gloo (CPU) as on NCCL.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .llama import Llama

# Checkpoint module names by how their tensors are split: along the output rows (weights and
# biases), along the input columns (weights; biases are replicated and added once), or along
# the vocabulary rows.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class Sharding:
    """This process's place in a tensor-parallel group.

    rank: 0 <= rank < world_size, the rank within `group`.
    world_size: the number of ranks the model is split over.
    group: the process group (None: the default, WORLD).
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def block(self, size: int) -> slice:
        """This rank's block of a dimension of `size` (divisible by world_size)."""
        step = size // self.world_size
        return slice(self.rank * step, (self.rank + 1) * step)


def local_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    """The config of one rank's shard: heads, KV heads and MLP width divided by
    `world_size` (ValueError naming each field that does not divide)."""
    fields = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    bad = [f"{name}={value}" for name, value in fields.items() if value % world_size]
    if bad:
        raise ValueError(
            f"tensor parallelism over {world_size} ranks needs {', '.join(bad)} to be "
            f"multiples of {world_size}; choose a number of ranks that divides them"
        )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local W_local^T) + b: this rank's block of the input columns.

    Args:
        in_features: the rank's block of the input features.
        out_features: the full output size (replicated on every rank).
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, sharding: Sharding
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.sharding = sharding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] (the rank's block) -> [..., out_features]."""
        partial = F.linear(x, self.weight)
        out = funcol.all_reduce(partial, "sum", self.sharding.process_group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows are split by vocabulary; every rank returns the full result.

    Args:
        vocab_size: the full vocabulary.
        hidden_size: the embedding width.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, sharding: Sharding) -> None:
        rows = sharding.block(vocab_size)
        super().__init__(rows.stop - rows.start, hidden_size)
        self.sharding = sharding
        self.vocab_start = rows.start

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [...] int64 in [0, vocab_size) -> [..., hidden_size]."""
        local = tokens - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        rows = rows * mine[..., None].to(rows.dtype)
        return funcol.all_reduce(rows, "sum", self.sharding.process_group)


class VocabParallelLMHead(nn.Linear):
    """An LM head whose rows are split by vocabulary; the logits are gathered, so every rank
    returns all of them."""

    def __init__(self, hidden_size: int, vocab_size: int, *, sharding: Sharding) -> None:
        rows = sharding.block(vocab_size)
        super().__init__(hidden_size, rows.stop - rows.start, bias=False)
        self.sharding = sharding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden_size] -> [..., vocab_size] logits."""
        # Gathered along the leading dim (the one the functional all-gather op supports): the
        # vocabulary. The op itself, since its Python wrapper's name differs between torch
        # releases (all_gather_tensor in 2.11, all_gather_single later).
        local = F.linear(hidden, self.weight).movedim(-1, 0).contiguous()
        group = self.sharding.process_group
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(
            local, dist.get_world_size(group), group.group_name
        )
        return funcol.wait_tensor(gathered).movedim(0, -1)


def build_sharded_llama(
    config: LlamaConfig, sharding: Sharding, *, tap_layers: tuple[int, ...] | None = None
) -> Llama:
    """One rank's Llama for the unsharded `config` (build it on the meta device and load it
    with `load_sharded_target`, or copy weights in through `shard_slices`)."""
    local = local_config(config, sharding.world_size)
    model = Llama(local, tap_layers=tap_layers)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(
            local.num_heads * local.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            sharding=sharding,
        )
        mlp.down_proj = RowParallelLinear(
            local.intermediate_size, config.hidden_size, bias=config.mlp_bias, sharding=sharding
        )
    model.embed_tokens = VocabParallelEmbedding(
        config.vocab_size, config.hidden_size, sharding=sharding
    )
    model.lm_head = VocabParallelLMHead(config.hidden_size, config.vocab_size, sharding=sharding)
    model.tie_weights()
    return model


def shard_slices(name: str, shape: tuple[int, ...], sharding: Sharding) -> tuple[slice, ...]:
    """The block of checkpoint tensor `name` (unsharded state-dict name, of `shape`) that
    this rank holds: rows of column-parallel and vocabulary-parallel tensors, columns of
    row-parallel weights, everything of the rest."""
    module, _, leaf = name.rpartition(".")
    module = module.rpartition(".")[2]
    whole = tuple(slice(None) for _ in shape)
    if module in COLUMN_PARALLEL or module in VOCAB_PARALLEL:
        return (sharding.block(shape[0]), *whole[1:])
    if module in ROW_PARALLEL and leaf == "weight":
        return (whole[0], sharding.block(shape[1]))
    return whole
