"""The Triton kernels of `rt::topk` and `rt::log_softmax_topk` and their launcher.

Imported only where Triton is installed, by the ops' CUDA path in topk.py (and by the
TRITON_INTERPRET tests): topk.py states the selection order and the two stages, and holds the
references that every other caller runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton import wrap
from .arrivals import arrival_counters
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
def _store_key(key, values_ptr, columns_ptr, offset, mask):
    """Unpack keys (one, or a vector where `mask`) into their values minus `offset` (in the
    output's dtype) and their columns."""
    ordered = (key >> 32).to(tl.int32)
    value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tl.store(values_ptr, (value - offset).to(values_ptr.dtype.element_ty), mask=mask)
    low_word = tl.full((), 0xFFFFFFFF, tl.int64)
    tl.store(columns_ptr, low_word - (key & low_word), mask=mask)


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
    """Combine a row's per-chunk (max, sum) pairs (other programs wrote them: read past L1)
    into its log-sum-exp."""
    chunk = tl.arange(0, CHUNKS)
    present = chunk < num_chunks
    base = stats_ptr + (row * num_chunks + chunk) * 2
    chunk_max = tl.load(base, mask=present, other=float("-inf"), cache_modifier=".cg")
    chunk_sum = tl.load(base + 1, mask=present, other=0.0, cache_modifier=".cg")
    row_max = tl.max(chunk_max, 0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    return shift + tl.log(tl.sum(chunk_sum * tl.exp(chunk_max - shift), 0))


@triton.jit
def _store_best(keys, values_ptr, columns_ptr, keys_out_ptr, offset, K: tl.constexpr,
                AS_KEYS: tl.constexpr):  # fmt: skip
    """The K largest of `keys`, best first: as keys at keys_out_ptr + i (AS_KEYS), else as
    values minus `offset` and columns at values_ptr + i and columns_ptr + i."""
    for i in tl.static_range(K):
        best = tl.max(keys, 0)
        # Keys are distinct (their columns are), so this removes exactly the winner.
        keys = tl.where(keys == best, _NO_KEY, keys)
        if AS_KEYS:
            tl.store(keys_out_ptr + i, best)
        else:
            _store_key(best, values_ptr + i, columns_ptr + i, offset, True)


@triton.jit
def _store_best_sorted(keys, values_ptr, columns_ptr, keys_out_ptr, offset, K: tl.constexpr,
                       K_POW2: tl.constexpr, AS_KEYS: tl.constexpr):  # fmt: skip
    """_store_best by one bitonic selection of the K_POW2 (K rounded up to a power of 2)
    largest keys, best first, instead of K max-reductions one after another."""
    best = tl.topk(keys, K_POW2)
    i = tl.arange(0, K_POW2)
    if AS_KEYS:
        tl.store(keys_out_ptr + i, best, mask=i < K)
    else:
        _store_key(best, values_ptr + i, columns_ptr + i, offset, i < K)


@triton.jit
def _select(keys, values_ptr, columns_ptr, keys_out_ptr, offset, K: tl.constexpr,
            K_POW2: tl.constexpr, AS_KEYS: tl.constexpr, BY_SORT: tl.constexpr):  # fmt: skip
    """The K largest of `keys`, stored as _store_best does, by either method."""
    if BY_SORT:
        _store_best_sorted(keys, values_ptr, columns_ptr, keys_out_ptr, offset, K, K_POW2,
                           AS_KEYS)  # fmt: skip
    else:
        _store_best(keys, values_ptr, columns_ptr, keys_out_ptr, offset, K, AS_KEYS)


@triton.jit
def _topk_kernel(
    x_ptr, keys_ptr, values_ptr, columns_ptr, stats_ptr, arrivals_ptr,
    num_cols, stride_x, stride_out,
    K: tl.constexpr, BLOCK: tl.constexpr, TWO_STAGES: tl.constexpr,
    LOG_SOFTMAX: tl.constexpr, CHUNKS: tl.constexpr, MERGE_BLOCK: tl.constexpr,
    K_POW2: tl.constexpr, BY_SORT: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the top K entries of columns [chunk * BLOCK, (chunk + 1) * BLOCK)
    of a row, best first. One chunk a row: stored as values (minus the chunk's log-sum-exp
    with LOG_SOFTMAX) and columns at [row, i]. TWO_STAGES: stored as keys at [row, chunk * K
    + i] of keys [rows, chunks * K] (and, with LOG_SOFTMAX, the chunk's (max, sum) at stats
    [rows, chunks, 2]); then the row's last chunk to finish (counted in arrivals [rows],
    arrivals.py) takes the top K of the row's chunks * K keys (MERGE_BLOCK: that many rounded
    up to a power of 2) and stores them as values and columns. CHUNKS: the number of chunks
    rounded up to a power of 2. BY_SORT: each selection by one bitonic top-K_POW2 (K rounded
    up to a power of 2, at least 2; BLOCK at least K_POW2) instead of K max-reductions."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_cols
    x = tl.load(x_ptr + row * stride_x + offsets, mask=valid, other=0.0)
    keys = tl.where(valid, _sort_key(x, offsets.to(tl.int64)), _NO_KEY)
    offset = 0.0
    if LOG_SOFTMAX:
        chunk_max, chunk_sum = _chunk_stats(x, valid)
        if TWO_STAGES:
            stats = stats_ptr + (row * num_chunks + chunk) * 2
            tl.store(stats, chunk_max)
            tl.store(stats + 1, chunk_sum)
        else:
            shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
            offset = shift + tl.log(chunk_sum)
    out = row * stride_out
    if TWO_STAGES:
        row_keys = keys_ptr + row * num_chunks * K
        _select(keys, values_ptr, columns_ptr, row_keys + chunk * K, offset, K, K_POW2, True,
                BY_SORT)  # fmt: skip
        # Every thread's stores before the arrival; the last chunk reads them all.
        tl.debug_barrier()
        arrivals = arrivals_ptr + row
        if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
            tl.store(arrivals, 0)
            merged = tl.arange(0, MERGE_BLOCK)
            row_best = tl.load(row_keys + merged, mask=merged < num_chunks * K, other=_NO_KEY,
                               cache_modifier=".cg")  # fmt: skip
            row_offset = 0.0
            if LOG_SOFTMAX:
                row_offset = _row_log_sum_exp(stats_ptr, row, num_chunks, CHUNKS)
            _select(row_best, values_ptr + out, columns_ptr + out, row_keys, row_offset, K,
                    K_POW2, False, BY_SORT)  # fmt: skip
    else:
        _select(keys, values_ptr + out, columns_ptr + out, keys_ptr, offset, K, K_POW2, False,
                BY_SORT)  # fmt: skip


@dataclass(frozen=True)
class TopkConfig:
    """One launch form: each row in chunks of `block` columns (a power of 2), a program of
    `num_warps` warps per chunk; with `by_sort`, each program selects its k by one bitonic
    top-k (Triton's `tl.topk`, k rounded up to a power of 2, at least 2) instead of k
    max-reductions in turn."""

    block: int
    num_warps: int
    by_sort: bool = False


def topk_config(num_rows: int, num_cols: int) -> TopkConfig:
    """The launch form for a top-k of `num_rows` rows of `num_cols` columns (any k up to
    topk.py's MAX_K: the launcher widens a sort form's chunks to hold k), fitted to
    `specrun bench topk --sweep` on an H200 (BENCHMARKS.md).

    A draft vocabulary's row (14,336 or 32,000 columns) is fastest in chunks of 512 or 1024
    columns, merged by the last (tens of chunks, so a merge of a few hundred keys). Up to
    16,384 columns and 8 rows (the embedded head's root, its levels and the rerank) each
    program selects by one bitonic top-k of 4 warps (8 for a row that is one chunk): 3.2
    against 9.4 us for the rerank's 39 of 328, 4.0 against 5.6 for the root, 4.8 against
    6.0 for a level. Elsewhere by k max-reductions in turn, with fewer warps as rows add
    programs: 4 for one row, 2 up to 8 rows, 1 beyond (the sort form was not swept there).
    Rows longer than 32,768 (a target's vocabulary) keep MAX_CHUNK-column chunks of 8
    warps, so that a merge of chunks * k keys stays small."""
    if num_cols > 32768:
        return TopkConfig(block=MAX_CHUNK, num_warps=8)
    if num_cols <= 16384 and num_rows <= 8:
        return TopkConfig(block=512, num_warps=8 if num_cols <= 512 else 4, by_sort=True)
    block = 512 if num_cols <= 16384 else 1024
    return TopkConfig(block=block, num_warps=4 if num_rows == 1 else 2 if num_rows <= 8 else 1)


def launch_topk(
    x: torch.Tensor, k: int, *, log_softmax: bool = False, config: TopkConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernels on x [R, V] (last dim contiguous), with `config` or the one
    `topk_config` picks. Returns values [R, k] (in x's dtype; float32 log-probabilities with
    `log_softmax`) and columns [R, k] int64. Used by the ops, by the interpreter tests and by
    `specrun bench topk`."""
    num_rows, num_cols = x.shape
    if config is None:
        config = topk_config(num_rows, num_cols)
    block = min(triton.next_power_of_2(num_cols), config.block)
    # tl.topk selects at least 2 (one key would reduce to a scalar); a chunk holds them all.
    k_pow2 = max(2, triton.next_power_of_2(k))
    if config.by_sort:
        block = max(block, k_pow2)
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
    # One launch: the last chunk of a row to finish merges the row's chunks (see the kernel).
    arrivals = arrival_counters(x, num_rows) if two_stages else columns
    wrap(_topk_kernel)[(num_rows, num_chunks)](
        x, keys, values, columns, stats, arrivals, num_cols, x.stride(0), k,
        K=k, BLOCK=block, TWO_STAGES=two_stages, LOG_SOFTMAX=log_softmax, CHUNKS=chunks,
        MERGE_BLOCK=triton.next_power_of_2(num_chunks * k), K_POW2=k_pow2, BY_SORT=config.by_sort,
        num_warps=config.num_warps,
    )  # fmt: skip
    return values, columns
