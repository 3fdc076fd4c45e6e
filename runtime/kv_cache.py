"""Static KV storage: per-layer K/V buffers of fixed capacity plus per-slot lengths on the device.

Shapes never change after allocation, so the same buffers serve eager code, compiled code and
replayed CUDA graphs. Appends write at each slot's own length: slots are ragged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.config import LlamaConfig
from ..models.llama import AttentionInputs


@dataclass
class KVCache:
    """k, v: [L, B, Hkv, S, D]; lengths: [B] int64 committed tokens per slot."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def allocate(
        cls,
        config: LlamaConfig,
        *,
        num_layers: int | None = None,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """Zeroed cache for `batch_size` slots of `capacity` positions each."""
        shape = (
            num_layers or config.num_layers,
            batch_size,
            config.num_kv_heads,
            capacity,
            config.head_dim,
        )
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.int64, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def attention_inputs(self, anc: torch.Tensor) -> AttentionInputs:
        """Inputs for a forward whose new tokens form the tree described by anc [B, T, W]."""
        return AttentionInputs(self.k, self.v, self.lengths, anc)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, num_new: torch.Tensor) -> None:
        """Write new K/V at each slot's length and advance it by num_new.

        All T positions are written (entries past num_new are garbage beyond the new length,
        never read); the caller guarantees lengths + T <= capacity.

        Args:
            k_new, v_new: [L, B, Hkv, T, D].
            num_new: [B] int64, tokens to commit per slot (<= T).
        """
        num_layers, batch, num_heads, num_tokens, _ = k_new.shape
        device = k_new.device
        # Indices broadcast to [L, B, Hkv, T]. An index_put_, not a scatter_ along dim 3:
        # Inductor writes index_put_ in place into the cache, but compiles a scatter_ of a
        # graph input as a copy of the whole cache, scattered, then copied back (twice the
        # cache's bytes per step, whatever T).
        index = (
            torch.arange(num_layers, device=device).view(-1, 1, 1, 1),
            torch.arange(batch, device=device).view(1, -1, 1, 1),
            torch.arange(num_heads, device=device).view(1, 1, -1, 1),
            (self.lengths[:, None] + torch.arange(num_tokens, device=device))[None, :, None],
        )
        self.k.index_put_(index, k_new.to(self.k.dtype))
        self.v.index_put_(index, v_new.to(self.v.dtype))
        self.lengths += num_new
