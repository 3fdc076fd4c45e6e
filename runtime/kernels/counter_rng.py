"""`rt::counter_uniform`: counter-based uniforms, a pure function of (seed, counter, site,
element index); the random numbers every draw of a round uses (runtime/rng.py says why).

Bits: a 32-bit row key hashes the seed's two halves, the site and the counter; element i of
a row gets mix(row ^ (i * SALT mod 2^32)), whose top 24 bits make a float32 in (0, 1). `mix`
is a bijective xorshift-multiply avalanche on 32-bit values held in int64, with multipliers
below 2^31 so no product overflows: PyTorch, Inductor and Triton compute the same bits.

An opaque custom op, not a decomposable `triton_op`: inlined into a compiled round, the
integer chain made Inductor's code generation several times slower (value-range analysis of
every op, in every consumer), while as one op it is one small write per draw. On CUDA with
Triton it launches `_counter_uniform_kernel` (counter_rng_triton.py); elsewhere it runs
`counter_uniform_ref`.
"""

from __future__ import annotations

import torch

from ._triton import uses_triton

MASK32 = 0xFFFFFFFF
SALT = 0x61C88647  # 2^32 / golden ratio, below 2^31
MIX_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)
UNIFORM_BITS = 24


def mix_ref(x: torch.Tensor) -> torch.Tensor:
    """The avalanche of 32-bit values in int64 [...] (each product stays below 2^63)."""
    first, second = MIX_MULTIPLIERS
    x = x ^ (x >> 16)
    x = (x * first) & MASK32
    x = x ^ (x >> 15)
    x = (x * second) & MASK32
    return x ^ (x >> 16)


def row_keys_ref(seed: torch.Tensor, counter: torch.Tensor, site: int) -> torch.Tensor:
    """Row keys [B, L] int64 of seed halves [B, 2] and counters [B, L]."""
    low, high = seed[:, :1], seed[:, 1:]
    row = mix_ref(mix_ref(low ^ (site * SALT & MASK32)) ^ high)
    return mix_ref(row ^ (counter & MASK32))


def counter_uniform_ref(
    seed: torch.Tensor, counter: torch.Tensor, num_elements: int, site: int
) -> torch.Tensor:
    """Plain-PyTorch `counter_uniform`: [B, L, num_elements] float32 in (0, 1)."""
    row = row_keys_ref(seed, counter, site)[..., None]
    index = torch.arange(num_elements, device=counter.device)
    bits = mix_ref(row ^ (index * SALT & MASK32)) >> (32 - UNIFORM_BITS)
    return (bits.float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


@torch.library.custom_op("rt::counter_uniform", mutates_args=())
def counter_uniform(
    seed: torch.Tensor, counter: torch.Tensor, num_elements: int, site: int
) -> torch.Tensor:
    """Uniforms in (0, 1) keyed by (seed, counter, site, element index).

    Args:
        seed: [B, 2] int64 seed halves (each < 2^32).
        counter: [B, L] int64 counters (>= 0; only the low 32 bits count).
        num_elements: uniforms per (row, counter).
        site: which draw they are for (a small int, `rng.Site`).
    Returns:
        [B, L, num_elements] float32.
    """
    if uses_triton(seed.device):
        # Imported here, not at the top: this module must load where Triton is missing.
        from .counter_rng_triton import launch_counter_uniform

        return launch_counter_uniform(seed, counter, num_elements, site)
    return counter_uniform_ref(seed, counter, num_elements, site)


@counter_uniform.register_fake
def _counter_uniform_fake(seed, counter, num_elements, site):
    return counter.new_empty((*counter.shape, num_elements), dtype=torch.float32)
