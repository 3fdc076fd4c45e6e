"""Sync-free sampling: per-slot temperature / top-k / top-p, and exact categorical draws.

Every function takes per-slot parameter tensors, so one batch mixes greedy and sampled requests
without Python branching on values; greedy rows become a one-hot distribution on the argmax,
which lets speculative verification treat greedy as the special case of sampling it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import SamplingParams


@dataclass(frozen=True)
class SamplingTensors:
    """Per-slot sampling parameters on the device.

    temperature: [B] float32 (0 = greedy); top_k: [B] int64 (0 = off); top_p: [B] float32.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
        )


def target_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """The distribution a request samples from.

    Args:
        logits: [B, ..., V] any float dtype.
        sampling: per-slot parameters, each [B].
    Returns:
        [B, ..., V] float32 probabilities; greedy slots get a one-hot on the argmax.
    """
    logits = logits.float()
    per_slot = (-1,) + (1,) * (logits.dim() - 1)
    temperature = sampling.temperature.view(per_slot)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    top_k = sampling.top_k.view(per_slot)
    sorted_logits = sorted_logits.masked_fill((top_k > 0) & (rank >= top_k), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p.view(per_slot), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One exact categorical draw per row, without a host sync.

    argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i.

    Args:
        probs: [..., V] float probabilities (rows need not be normalised).
    Returns:
        [...] int64 token ids.
    """
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise.clamp_min(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)
