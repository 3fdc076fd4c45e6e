"""The Triton kernels of `rt::topk` and `rt::log_softmax_topk` and their launcher.

Imported only where Triton is installed, by the ops' CUDA path in topk.py (and by the
TRITON_INTERPRET tests): topk.py states the selection order and the two stages, and holds the
references that every other caller runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import wrap
from .topk import MAX_CHUNK

# Below every entry's key: padding, and entries already taken.
_NO_KEY = tl.constexpr(-9223372036854775808)


@triton.jit
def _sort_key(x, column):
    """int64 keys ordered as (x descending, column ascending): the float32 bits made
    order-preserving as signed ints in the high word, the column's complement in the low."""
    x = x.to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties with 0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (tl.full((), 0xFFFFFFFF, tl.int64) - column)


@triton.jit
def _store_key(key, values_ptr, columns_ptr, offset):
    """Unpack one key into its value minus `offset` (in the output's dtype) and its column."""
    ordered = (key >> 32).to(tl.int32)
    value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tl.store(values_ptr, (value - offset).to(values_ptr.dtype.element_ty))
    low_word = tl.full((), 0xFFFFFFFF, tl.int64)
    tl.store(columns_ptr, low_word - (key & low_word))


@triton.jit
def _chunk_stats(x, valid):
    """(max, sum of exp(x - max)) over the valid entries of a chunk, in float32."""
    x = tl.where(valid, x.to(tl.float32), float("-inf"))
    chunk_max = tl.max(x, 0)
    # An all -inf chunk sums to 0 and merges as nothing; exp(-inf - -inf) would be NaN.
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    return chunk_max, tl.sum(tl.exp(x - shift), 0)


@triton.jit
def _row_log_sum_exp(stats_ptr, row, num_chunks, CHUNKS: tl.constexpr):
    """Combine a row's per-chunk (max, sum) pairs into its log-sum-exp."""
    chunk = tl.arange(0, CHUNKS)
    present = chunk < num_chunks
    base = stats_ptr + (row * num_chunks + chunk) * 2
    chunk_max = tl.load(base, mask=present, other=float("-inf"))
    chunk_sum = tl.load(base + 1, mask=present, other=0.0)
    row_max = tl.max(chunk_max, 0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    return shift + tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - shift), 0))


@triton.jit
def _topk_kernel(
    x_ptr, keys_ptr, values_ptr, columns_ptr, stats_ptr,
    num_cols, stride_x, stride_out,
    K: tl.constexpr, BLOCK: tl.constexpr, FROM_KEYS: tl.constexpr, TO_KEYS: tl.constexpr,
    LOG_SOFTMAX: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the top K entries of columns [chunk * BLOCK, (chunk + 1) * BLOCK)
    of a row, best first, at [row, chunk * K + i] of the outputs: as keys (TO_KEYS, stage 1 of
    two) or as values and columns. FROM_KEYS (stage 2) reads keys instead of x. LOG_SOFTMAX:
    stage 1 also writes its chunk's (max, sum) to stats [rows, chunks, 2] (two stages) or
    subtracts its log-sum-exp (one stage); stage 2 combines the row's chunks into its
    log-sum-exp and subtracts that. CHUNKS: the number of chunks rounded up to a power of 2."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_cols
    offset = 0.0
    if FROM_KEYS:
        keys = tl.load(keys_ptr + row * num_cols + offsets, mask=valid, other=_NO_KEY)
        if LOG_SOFTMAX:
            offset = _row_log_sum_exp(stats_ptr, row, num_cols // K, CHUNKS)
    else:
        x = tl.load(x_ptr + row * stride_x + offsets, mask=valid, other=0.0)
        keys = tl.where(valid, _sort_key(x, offsets.to(tl.int64)), _NO_KEY)
        if LOG_SOFTMAX:
            chunk_max, chunk_sum = _chunk_stats(x, valid)
            if TO_KEYS:
                stats = stats_ptr + (row * tl.num_programs(1) + chunk) * 2
                tl.store(stats, chunk_max)
                tl.store(stats + 1, chunk_sum)
            else:
                shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
                offset = shift + tl.log(chunk_sum)
    out = row * stride_out + chunk * K
    for i in tl.static_range(K):
        best = tl.max(keys, 0)
        # Keys are distinct (their columns are), so this removes exactly the winner.
        keys = tl.where(keys == best, _NO_KEY, keys)
        if TO_KEYS:
            tl.store(keys_ptr + out + i, best)
        else:
            _store_key(best, values_ptr + out + i, columns_ptr + out + i, offset)


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def launch_topk(
    x: torch.Tensor, k: int, *, log_softmax: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernels on x [R, V] (last dim contiguous). Returns values [R, k] (in x's
    dtype; float32 log-probabilities with `log_softmax`) and columns [R, k] int64. Used by the
    ops and by the interpreter tests."""
    num_rows, num_cols = x.shape
    block = min(triton.next_power_of_2(num_cols), MAX_CHUNK)
    num_chunks = triton.cdiv(num_cols, block)
    values_dtype = torch.float32 if log_softmax else x.dtype
    values = torch.empty((num_rows, k), dtype=values_dtype, device=x.device)
    columns = torch.empty((num_rows, k), dtype=torch.int64, device=x.device)
    two_stages = num_chunks > 1
    # One stage reads and writes no keys, and only a two-stage log-softmax writes stats: any
    # pointer of the right type stands in for those.
    keys = (
        torch.empty((num_rows, num_chunks * k), dtype=torch.int64, device=x.device)
        if two_stages
        else columns
    )
    stats = (
        torch.empty((num_rows, num_chunks, 2), dtype=torch.float32, device=x.device)
        if two_stages and log_softmax
        else values
    )
    chunks = triton.next_power_of_2(num_chunks)
    wrap(_topk_kernel)[(num_rows, num_chunks)](
        x, keys, values, columns, stats, num_cols, x.stride(0), keys.shape[-1],
        K=k, BLOCK=block, FROM_KEYS=False, TO_KEYS=two_stages, LOG_SOFTMAX=log_softmax,
        CHUNKS=chunks, num_warps=_num_warps(block),
    )  # fmt: skip
    if two_stages:
        block = triton.next_power_of_2(num_chunks * k)
        wrap(_topk_kernel)[(num_rows, 1)](
            x, keys, values, columns, stats, num_chunks * k, x.stride(0), k,
            K=k, BLOCK=block, FROM_KEYS=True, TO_KEYS=False, LOG_SOFTMAX=log_softmax,
            CHUNKS=chunks, num_warps=_num_warps(block),
        )  # fmt: skip
    return values, columns
