"""Counter-based random numbers: every draw a function of (request seed, token position, draw
site, element), computed inside the graphs from integer hashing.

A request's random numbers therefore do not depend on which other requests share its batch,
which slot it occupies, the round it was admitted at, or what the caller's own code draws: a
seeded request decodes the same tokens alone or in any batch, and no process-wide generator
is read or advanced (the caller's `torch.rand` is untouched, and CUDA graphs replay no
generator state). The target's draw for output position p uses the same numbers in the
reference decoder, a plain step and every node at that position of a speculative tree, so a
seeded request samples the same tokens with or without speculation (top-k trees).

Keys: a seed is 64 bits, kept as two int64 halves [B, 2] (each < 2^32); a counter [B, ...]
int64 is the output position the draw is for (plus a level for the draft's draws); a site is
a small constant per place that draws (`Site`); the element index runs over the draw's
trailing dims. The hashing itself is `rt::counter_uniform` (runtime/kernels/counter_rng.py):
every backend computes the same bits. Uniforms have 24 random bits (float32's mantissa).
"""

from __future__ import annotations

import enum
import math
import secrets

import torch

from .kernels.counter_rng import MASK32, counter_uniform


class Site(enum.IntEnum):
    """Where a draw happens; each gets numbers of its own for the same seed and counter."""

    TARGET = 1  # the target's next token: prefill root, plain step, verify (every node)
    DRAFT = 2  # a stochastic tree's sampled children (counter: position + level)
    REJECTION = 3  # the rejection walk's uniforms
    RESIDUAL = 4  # the bonus drawn from the residual where the walk stopped


def seed_halves(seed: int | None) -> tuple[int, int]:
    """A request's 64-bit seed as (low, high) 32-bit halves; a request without one gets a
    fresh seed (from the OS's entropy, not torch's generator)."""
    if seed is None:
        seed = secrets.randbits(64)
    return seed & MASK32, (seed >> 32) & MASK32


def uniform(
    seed: torch.Tensor, counter: torch.Tensor, shape: tuple[int, ...], *, site: Site
) -> torch.Tensor:
    """Uniforms in (0, 1), one per element, keyed by (seed, counter, site, element index)
    (`rt::counter_uniform`, runtime/kernels/counter_rng.py).

    Args:
        seed: [B, 2] int64 seed halves.
        counter: [B, ...] int64 (>= 0, < 2^32): one key per leading index.
        shape: the trailing dims drawn per key.
    Returns:
        [*counter.shape, *shape] float32.
    """
    rows = counter.reshape(counter.shape[0], -1)
    drawn = counter_uniform(seed, rows, math.prod(shape), int(site))
    return drawn.view(*counter.shape, *shape)


def exponential(
    seed: torch.Tensor, counter: torch.Tensor, shape: tuple[int, ...], *, site: Site
) -> torch.Tensor:
    """Exp(1) noise shaped like `uniform`'s result (float32, > 0)."""
    return -torch.log(uniform(seed, counter, shape, site=site))


def gumbel(
    seed: torch.Tensor, counter: torch.Tensor, shape: tuple[int, ...], *, site: Site
) -> torch.Tensor:
    """Standard Gumbel noise shaped like `uniform`'s result (float32)."""
    return -torch.log(exponential(seed, counter, shape, site=site))
