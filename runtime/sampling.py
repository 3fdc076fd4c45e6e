"""Sync-free sampling: per-slot temperature / top-k / top-p, and exact categorical draws.

Every function takes per-slot parameter tensors, so one batch mixes greedy and sampled requests
without Python branching on values; greedy rows become a one-hot distribution on the argmax,
which lets speculative verification treat greedy as the special case of sampling it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.attention import readable_on_host
from .config import SamplingParams
from .rng import Site, exponential, gumbel, seed_halves


@dataclass(frozen=True)
class SamplingTensors:
    """Per-slot sampling parameters on the device.

    temperature: [B] float32 (0 = greedy); top_k: [B] int64 (0 = off); top_p: [B] float32.
    seed: [B, 2] int64 each request's seed halves (runtime/rng.py); position: [B] int64 the
        number of tokens each request has emitted (the decoding state's `num_output`, shared,
        not copied): the counter of the target's next draw. Both are needed only to draw.
    seeded: [B] bool whether the request gave its seed. A seeded request must sample the
        same tokens whatever tree its rounds run, so it never drafts a stochastic tree,
        whose accepted tokens depend on the tree (runtime/stochastic.py); None: no row is.
    filtered: whether top-k / top-p may be on for some slot. When False they are ignored and
        the full-vocabulary sort they need is skipped; being a Python flag, it selects a
        separately compiled (and captured) variant of a round.
    greedy: every slot is greedy (a Python flag like `filtered`: the round variant of a
        greedy batch): the target's draws take the argmax and draw no noise.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor | None = None
    position: torch.Tensor | None = None
    seeded: torch.Tensor | None = None
    filtered: bool = True
    greedy: bool = False

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str,
        *,
        position: torch.Tensor | None = None,
    ) -> SamplingTensors:
        """Tensors of `params` (unseeded requests get fresh seeds); `position` [B] int64 the
        tokens emitted so far (zeros when not given)."""
        seeds = [seed_halves(p.seed) for p in params]
        if position is None:
            position = torch.zeros(len(params), dtype=torch.int64, device=device)
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            seed=torch.tensor(seeds, dtype=torch.int64, device=device).view(len(params), 2),
            position=position,
            seeded=torch.tensor([p.seed is not None for p in params], device=device),
            filtered=needs_filtering(params),
        )

    def samples_stochastically(self) -> torch.Tensor:
        """[B] bool: rows that sample and may draft a stochastic tree (not seeded)."""
        samples = self.temperature > 0
        return samples if self.seeded is None else samples & ~self.seeded

    def counter(self, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """The draw counter of each slot, `position` + `offset` ([B] or [B, ...] int64)."""
        assert self.position is not None, "drawing needs SamplingTensors.position"
        if isinstance(offset, torch.Tensor):
            return self.position.view((-1,) + (1,) * (offset.dim() - 1)) + offset
        return self.position + offset


def needs_filtering(params: Sequence[SamplingParams]) -> bool:
    """Whether any request samples with top-k or top-p."""
    return any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy)


def draw_tokens(
    logits: torch.Tensor, sampling: SamplingTensors, offset: torch.Tensor | int = 0
) -> torch.Tensor:
    """The target's draw, one per row, from the distribution `target_probs` gives, without
    materialising it; keyed by each slot's seed and the output position it is for
    (`sampling.counter(offset)`), so the same position draws the same numbers wherever it is
    decoded.

    Without top-k / top-p this is the Gumbel-max form of `sample`'s exponential race,
    argmax(logits / T - log E) with E ~ Exp(1): the same ordering as argmax(p / E), since
    log p = logits / T - logsumexp, but one pass over the vocabulary instead of the four a
    softmax, its one-hot and the race take (the largest reduction of a plain step). Greedy
    rows take argmax(logits), as the one-hot does; with `sampling.greedy` every row does,
    and no noise is drawn.

    Args:
        logits: [B, ..., V] any float dtype.
        sampling: per-slot parameters, each [B].
        offset: [B, ...] int64 (logits' leading dims) or an int: each row's output position
            past `sampling.position` (a tree node's depth).
    Returns:
        [B, ...] int64 token ids.
    """
    # A greedy batch's round, or eager on the CPU with every row greedy: no noise to draw.
    if sampling.greedy or (
        readable_on_host(sampling.temperature) and not bool((sampling.temperature > 0).any())
    ):
        return _chunked_argmax(logits)
    counter = _broadcast_counter(sampling, offset, logits)
    if sampling.filtered:
        return sample(target_probs(logits, sampling), sampling.seed, counter, site=Site.TARGET)
    logits = logits.float()
    temperature = sampling.temperature.view((-1,) + (1,) * (logits.dim() - 1))
    greedy = temperature == 0
    noise = gumbel(sampling.seed, counter, logits.shape[-1:], site=Site.TARGET)
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)
    return _chunked_argmax(torch.where(greedy, logits, scaled + noise))


def _broadcast_counter(
    sampling: SamplingTensors, offset: torch.Tensor | int, logits: torch.Tensor
) -> torch.Tensor:
    """The counter of every row of `logits` [B, ..., V]: [B, ...] int64."""
    counter = sampling.counter(offset)
    counter = counter.view(counter.shape + (1,) * (logits.dim() - 1 - counter.dim()))
    return counter.expand(logits.shape[:-1])


def _chunked_argmax(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """argmax over the last dim (the first index on ties, as `argmax`) in two reductions: per
    chunk of `chunk` columns, then over the chunks' maxima. A row of a large vocabulary is
    otherwise one reduction that Inductor gives a single thread block (and fuses with the
    step's other reductions, so it never splits it): 38 us of a 1.2 ms step."""
    size = x.shape[-1]
    blocks = F.pad(x, (0, -size % chunk), value=float("-inf")).unflatten(-1, (-1, chunk))
    block_max, block_argmax = blocks.max(dim=-1)
    best_block = block_max.argmax(dim=-1, keepdim=True)
    return (best_block * chunk + block_argmax.gather(-1, best_block)).squeeze(-1)


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
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if not sampling.filtered:
        return torch.where(greedy, one_hot, scaled.softmax(dim=-1))
    return torch.where(greedy, one_hot, _filtered_probs(scaled, sampling, per_slot))


def _filtered_probs(
    scaled: torch.Tensor, sampling: SamplingTensors, per_slot: tuple[int, ...]
) -> torch.Tensor:
    """softmax(scaled) restricted to each slot's top-k and top-p set, renormalised."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    top_k = sampling.top_k.view(per_slot)
    sorted_logits = sorted_logits.masked_fill((top_k > 0) & (rank >= top_k), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = _chunked_cumsum(sorted_probs) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p.view(per_slot), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _chunked_cumsum(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """cumsum over the last dim as a scan within chunks plus a scan over chunk totals.

    Inductor (torch 2.11) fails to generate code for the split scan it picks for one long
    row (a 128k vocabulary); two short scans never split."""
    size = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -size % chunk)).unflatten(-1, (-1, chunk))
    inner = blocks.cumsum(dim=-1)
    totals = inner[..., -1]
    offsets = totals.cumsum(dim=-1) - totals
    return (inner + offsets[..., None]).flatten(-2)[..., :size]


def sample(
    probs: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, *, site: Site
) -> torch.Tensor:
    """One exact categorical draw per row, without a host sync.

    argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i; E is keyed by
    (seed, counter, site) (runtime/rng.py).

    Args:
        probs: [B, ..., V] float probabilities (rows need not be normalised).
        seed: [B, 2] int64 seed halves; counter: [B, ...] int64, probs' leading dims.
    Returns:
        [B, ...] int64 token ids.
    """
    noise = exponential(seed, counter, probs.shape[-1:], site=site)
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
