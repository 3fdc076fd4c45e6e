"""The Triton kernel of `rt::counter_uniform` and its launcher.

Imported only where Triton is installed, by the op's CUDA path: counter_rng.py states the
bits, which `counter_uniform_ref` computes the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counter_rng import MASK32, MIX_MULTIPLIERS, SALT, UNIFORM_BITS

_BLOCK = 1024


@triton.jit
def _mix(x, FIRST: tl.constexpr, SECOND: tl.constexpr):
    x = x ^ (x >> 16)
    x = (x * FIRST) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * SECOND) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _counter_uniform_kernel(
    seed_ptr,
    counter_ptr,
    out_ptr,
    num_counters,
    num_elements,
    site_salt,
    FIRST: tl.constexpr,
    SECOND: tl.constexpr,
    SALT_: tl.constexpr,
    SHIFT: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row_index = tl.program_id(0)
    batch = row_index // num_counters
    low = tl.load(seed_ptr + 2 * batch).to(tl.int64)
    high = tl.load(seed_ptr + 2 * batch + 1).to(tl.int64)
    counter = tl.load(counter_ptr + row_index).to(tl.int64) & 0xFFFFFFFF
    row = _mix(_mix(low ^ site_salt, FIRST, SECOND) ^ high, FIRST, SECOND)
    row = _mix(row ^ counter, FIRST, SECOND)
    index = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    bits = _mix(row ^ ((index * SALT_) & 0xFFFFFFFF), FIRST, SECOND) >> SHIFT
    values = (bits.to(tl.float32) + 0.5) * SCALE
    tl.store(
        out_ptr + row_index.to(tl.int64) * num_elements + index, values, mask=index < num_elements
    )


def launch_counter_uniform(
    seed: torch.Tensor, counter: torch.Tensor, num_elements: int, site: int
) -> torch.Tensor:
    """[B, L, num_elements] float32 uniforms on the seed's device (CUDA)."""
    seed, counter = seed.contiguous(), counter.contiguous()
    out = torch.empty((*counter.shape, num_elements), dtype=torch.float32, device=seed.device)
    batch, num_counters = counter.shape
    if out.numel() == 0:
        return out
    grid = (batch * num_counters, triton.cdiv(num_elements, _BLOCK))
    first, second = MIX_MULTIPLIERS
    _counter_uniform_kernel[grid](
        seed, counter, out, num_counters, num_elements, site * SALT & MASK32,
        FIRST=first, SECOND=second, SALT_=SALT, SHIFT=32 - UNIFORM_BITS,
        SCALE=1.0 / (1 << UNIFORM_BITS), BLOCK=_BLOCK,
    )  # fmt: skip
    return out
