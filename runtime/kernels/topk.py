"""`rt::topk`: the k largest entries of each row for small k, in Triton.

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
def _store_key(key, values_ptr, columns_ptr):
    """Unpack one key into its value (in the output's dtype) and its column."""
    ordered = (key >> 32).to(tl.int32)
    value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tl.store(values_ptr, value.to(values_ptr.dtype.element_ty))
    low_word = tl.full((), 0xFFFFFFFF, tl.int64)
    tl.store(columns_ptr, low_word - (key & low_word))


@triton.jit
def _topk_kernel(
    x_ptr, keys_ptr, values_ptr, columns_ptr,
    num_cols, stride_x, stride_out,
    K: tl.constexpr, BLOCK: tl.constexpr, FROM_KEYS: tl.constexpr, TO_KEYS: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the top K entries of columns [chunk * BLOCK, (chunk + 1) * BLOCK)
    of a row, best first, at [row, chunk * K + i] of the outputs: as keys (TO_KEYS, stage 1 of
    two) or as values and columns. FROM_KEYS (stage 2) reads keys instead of x."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_cols
    if FROM_KEYS:
        keys = tl.load(keys_ptr + row * num_cols + offsets, mask=valid, other=_NO_KEY)
    else:
        x = tl.load(x_ptr + row * stride_x + offsets, mask=valid, other=0.0)
        keys = tl.where(valid, _sort_key(x, offsets.to(tl.int64)), _NO_KEY)
    out = row * stride_out + chunk * K
    for i in tl.static_range(K):
        best = tl.max(keys, 0)
        # Keys are distinct (their columns are), so this removes exactly the winner.
        keys = tl.where(keys == best, _NO_KEY, keys)
        if TO_KEYS:
            tl.store(keys_ptr + out + i, best)
        else:
            _store_key(best, values_ptr + out + i, columns_ptr + out + i)


def _wrap(kernel):
    """wrap_triton, except for TRITON_INTERPRET kernels (older torch rejects those)."""
    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def launch_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernels on x [R, V] (last dim contiguous). Returns values [R, k] in x's
    dtype and columns [R, k] int64. Used by the op and by the interpreter tests."""
    num_rows, num_cols = x.shape
    block = min(triton.next_power_of_2(num_cols), MAX_CHUNK)
    num_chunks = triton.cdiv(num_cols, block)
    values = torch.empty((num_rows, k), dtype=x.dtype, device=x.device)
    columns = torch.empty((num_rows, k), dtype=torch.int64, device=x.device)
    two_stages = num_chunks > 1
    # One stage reads and writes no keys: any int64 pointer stands in for them.
    keys = (
        torch.empty((num_rows, num_chunks * k), dtype=torch.int64, device=x.device)
        if two_stages
        else columns
    )
    _wrap(_topk_kernel)[(num_rows, num_chunks)](
        x, keys, values, columns, num_cols, x.stride(0), keys.shape[-1],
        K=k, BLOCK=block, FROM_KEYS=False, TO_KEYS=two_stages, num_warps=_num_warps(block),
    )  # fmt: skip
    if two_stages:
        block = triton.next_power_of_2(num_chunks * k)
        _wrap(_topk_kernel)[(num_rows, 1)](
            x, keys, values, columns, num_chunks * k, x.stride(0), k,
            K=k, BLOCK=block, FROM_KEYS=True, TO_KEYS=False, num_warps=_num_warps(block),
        )  # fmt: skip
    return values, columns


def check_topk_inputs(x: torch.Tensor, k: int) -> None:
    """Raise ValueError unless rt::topk takes (x, k)."""
    if not x.is_floating_point() or x.dtype == torch.float64:
        raise ValueError(f"rt::topk takes float16, bfloat16 or float32 rows, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rt::topk needs rows of at least one entry, got shape {tuple(x.shape)}")
    if not 1 <= k <= min(MAX_K, x.shape[-1]):
        raise ValueError(f"rt::topk takes 1 <= k <= min({MAX_K}, {x.shape[-1]}), got k={k}")


@triton_op("rt::topk", mutates_args=())
def _topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Also the fake impl and the decomposition torch.compile inlines: non-CUDA tensors
    # (CPU, meta) take the reference.
    check_topk_inputs(x, k)
    if x.device.type != "cuda":
        return topk_ref(x, k)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values, columns = launch_topk(rows, k)
    shape = (*x.shape[:-1], k)
    return values.view(shape), columns.view(shape)


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


@_topk_op.register_kernel("cpu")
def _topk_cpu(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the CPU: the reference."""
    check_topk_inputs(x, k)
    return topk_ref(x, k)
