"""`rt::topk` and `rt::log_softmax_topk`: the k largest entries of each row for small k, in Triton.

The draft picks a handful of children from each frontier node's distribution over the draft
vocabulary: topk with k <= 16 over [B * K, V] rows. ATen's topk runs a multi-pass radix
select per row, about 40 us on an H100 for [8, 8192] (a 135M target's plain step is 1.5 ms),
and a round drafting 5 levels paid for it five times. Here a program holds one chunk of a row
in registers as int64 keys, (value, column) packed so that one max-reduction picks the best
value and, among equal values, the lowest column; it takes the maximum k times, removing
each winner:

- stage 1: grid (rows, chunks); each chunk of at most `MAX_CHUNK` columns gives its own top k,
  best first (as keys when a second stage follows);
- stage 2 (only with more than one chunk): the same kernel over each row's chunks * k keys.

Order is defined exactly, unlike ATen's: values descending, equal values by ascending column,
so the kernel and `topk_ref` (a stable descending sort, cut at k) agree bit for bit. -inf
entries are ordinary values; rows must not hold NaN (log-probabilities never do).

`rt::log_softmax_topk` is the draft's "top k children and their log-probabilities": the same
selection on the logits (log-softmax keeps each row's order), reported as float32 logits
minus the row's log-sum-exp. Each stage-1 program also reduces its chunk to (max, sum of
exp(x - max)); the last stage combines a row's chunks and subtracts. One launch (two for rows
over `MAX_CHUNK`) replaces a log-softmax kernel, its float32 [rows, V] round trip and the topk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

MAX_K = 64
MAX_CHUNK = 2048
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


def _wrap(kernel):
    """wrap_triton, except for TRITON_INTERPRET kernels (older torch rejects those)."""
    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel


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
    _wrap(_topk_kernel)[(num_rows, num_chunks)](
        x, keys, values, columns, stats, num_cols, x.stride(0), keys.shape[-1],
        K=k, BLOCK=block, FROM_KEYS=False, TO_KEYS=two_stages, LOG_SOFTMAX=log_softmax,
        CHUNKS=chunks, num_warps=_num_warps(block),
    )  # fmt: skip
    if two_stages:
        block = triton.next_power_of_2(num_chunks * k)
        _wrap(_topk_kernel)[(num_rows, 1)](
            x, keys, values, columns, stats, num_chunks * k, x.stride(0), k,
            K=k, BLOCK=block, FROM_KEYS=True, TO_KEYS=False, LOG_SOFTMAX=log_softmax,
            CHUNKS=chunks, num_warps=_num_warps(block),
        )  # fmt: skip
    return values, columns


def check_topk_inputs(x: torch.Tensor, k: int, *, op: str = "rt::topk") -> None:
    """Raise ValueError unless `op` (rt::topk or rt::log_softmax_topk) takes (x, k)."""
    if op == "rt::log_softmax_topk":
        if not x.is_floating_point():
            raise ValueError(f"{op} takes floating-point rows, got {x.dtype}")
    elif not x.is_floating_point() or x.dtype == torch.float64:
        raise ValueError(f"{op} takes float16, bfloat16 or float32 rows, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op} needs rows of at least one entry, got shape {tuple(x.shape)}")
    if not 1 <= k <= min(MAX_K, x.shape[-1]):
        raise ValueError(f"{op} takes 1 <= k <= min({MAX_K}, {x.shape[-1]}), got k={k}")


def _launch_on_rows(
    x: torch.Tensor, k: int, *, log_softmax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """launch_topk over x [..., V] viewed as rows; outputs shaped [..., k]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values, columns = launch_topk(rows, k, log_softmax=log_softmax)
    shape = (*x.shape[:-1], k)
    return values.view(shape), columns.view(shape)


# Each op body is also its fake impl and the decomposition torch.compile inlines: non-CUDA
# tensors (CPU, meta) take the reference.


@triton_op("rt::topk", mutates_args=())
def _topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(x, k)
    if x.device.type != "cuda":
        return topk_ref(x, k)
    return _launch_on_rows(x, k, log_softmax=False)


@triton_op("rt::log_softmax_topk", mutates_args=())
def _log_softmax_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(x, k, op="rt::log_softmax_topk")
    # float64 rows (reference models in tests) would lose order in the kernel's float32 keys.
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return log_softmax_topk_ref(x, k)
    return _launch_on_rows(x, k, log_softmax=True)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of x, best first (`rt::topk`).

    Args:
        x: [..., V] float16 / bfloat16 / float32, no NaN.
        k: 1 <= k <= min(MAX_K, V).
    Returns:
        values [..., k] in x's dtype, descending, and their columns [..., k] int64; equal
        values come in ascending column order.
    Raises:
        ValueError: for other dtypes, empty rows or k out of range.
    """
    return torch.ops.rt.topk(x, k)


def topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `rt::topk` (same arguments, same result bit for bit)."""
    values, columns = x.sort(dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), columns[..., :k].contiguous()


def log_softmax_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely entries of each row of logits x, with their log-probabilities
    (`rt::log_softmax_topk`): `topk`'s selection, values x - logsumexp(x) in float32.

    Args:
        x: [..., V] floating-point logits (float64 takes the reference, on any device), no
            NaN, a finite entry per row.
        k: 1 <= k <= min(MAX_K, V).
    Returns:
        log-probabilities [..., k] float32, descending, and their columns [..., k] int64;
        equal logits come in ascending column order.
    Raises:
        ValueError: for integer rows, empty rows or k out of range.
    """
    return torch.ops.rt.log_softmax_topk(x, k)


def log_softmax_topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `rt::log_softmax_topk`: the same columns; the values agree to float32
    rounding (the kernel sums the exponentials in another order)."""
    values, columns = topk_ref(x, k)
    log_sum_exp = x.float().logsumexp(dim=-1, keepdim=True)
    return values.float() - log_sum_exp, columns


@_topk_op.register_kernel("cpu")
def _topk_cpu(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the CPU: the reference."""
    check_topk_inputs(x, k)
    return topk_ref(x, k)


@_log_softmax_topk_op.register_kernel("cpu")
def _log_softmax_topk_cpu(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the CPU: the reference."""
    check_topk_inputs(x, k, op="rt::log_softmax_topk")
    return log_softmax_topk_ref(x, k)
