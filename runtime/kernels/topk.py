"""`rt::topk`: the k largest entries of each row for small k, in Triton.

The draft picks a handful of children from each frontier node's distribution over the draft
vocabulary: topk with k <= 16 over [B * K, V] rows. ATen's topk runs a multi-pass radix
select per row, about 40 us on an H100 for [8, 8192], a fifth of a 135M target's whole plain
step; a round drafting 5 levels paid for it five times. Here a program holds one chunk of a
row in registers and takes its maximum k times, removing each winner:

- stage 1: grid (rows, chunks); each chunk of at most `MAX_CHUNK` columns gives its own top k
  (value, column) pairs, best first;
- stage 2 (only with more than one chunk): the same kernel over each row's chunks * k
  candidates, carrying their columns.

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
MAX_CHUNK = 8192


@triton.jit
def _topk_kernel(
    x_ptr, column_ptr, values_ptr, columns_ptr,
    num_cols, stride_x, stride_column, stride_out,
    K: tl.constexpr, BLOCK: tl.constexpr, HAS_COLUMNS: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the top K of x[row, chunk * BLOCK : (chunk + 1) * BLOCK] into
    values/columns[row, chunk * K : (chunk + 1) * K]. With HAS_COLUMNS, entry i stands for
    column column_ptr[row, i] (stage 2), else for its own position."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_cols
    x = tl.load(x_ptr + row * stride_x + offsets, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if HAS_COLUMNS:
        column = tl.load(column_ptr + row * stride_column + offsets, mask=valid, other=0)
    else:
        column = offsets.to(tl.int64)
    # Padding sorts after every real entry, -inf ones included: it has the largest column.
    column = tl.where(valid, column, 9223372036854775807)
    taken = offsets < 0
    out = values_ptr + row * stride_out + chunk * K
    out_columns = columns_ptr + row * stride_out + chunk * K
    for i in tl.static_range(K):
        remaining = tl.where(taken, float("-inf"), x)
        best = tl.max(remaining, 0)
        winner = tl.min(tl.where((remaining == best) & ~taken, column, 9223372036854775807), 0)
        taken = taken | (column == winner)
        tl.store(out + i, best.to(values_ptr.dtype.element_ty))
        tl.store(out_columns + i, winner)


def _wrap(kernel):
    """wrap_triton, except for TRITON_INTERPRET kernels (older torch rejects those)."""
    return wrap_triton(kernel) if isinstance(kernel, triton.runtime.JITFunction) else kernel


def _num_warps(block: int) -> int:
    return 8 if block >= 4096 else 4


def launch_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton kernels on x [R, V] (last dim contiguous). Returns values [R, k] in x's
    dtype and columns [R, k] int64. Used by the op and by the interpreter tests."""
    num_rows, num_cols = x.shape
    block = min(triton.next_power_of_2(num_cols), MAX_CHUNK)
    num_chunks = triton.cdiv(num_cols, block)
    # The candidates stay in x's dtype: exact, since they are copies of x's entries.
    values = torch.empty((num_rows, num_chunks * k), dtype=x.dtype, device=x.device)
    columns = torch.empty((num_rows, num_chunks * k), dtype=torch.int64, device=x.device)
    _wrap(_topk_kernel)[(num_rows, num_chunks)](
        x, columns, values, columns, num_cols, x.stride(0), 0, values.stride(0),
        K=k, BLOCK=block, HAS_COLUMNS=False, num_warps=_num_warps(block),
    )  # fmt: skip
    if num_chunks == 1:
        return values, columns
    out_values = torch.empty((num_rows, k), dtype=x.dtype, device=x.device)
    out_columns = torch.empty((num_rows, k), dtype=torch.int64, device=x.device)
    block = triton.next_power_of_2(num_chunks * k)
    _wrap(_topk_kernel)[(num_rows, 1)](
        values, columns, out_values, out_columns, num_chunks * k,
        values.stride(0), columns.stride(0), out_values.stride(0),
        K=k, BLOCK=block, HAS_COLUMNS=True, num_warps=_num_warps(block),
    )  # fmt: skip
    return out_values, out_columns


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
    if x.device.type != "cuda":
        return topk_ref(x, k)
    check_topk_inputs(x, k)
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
    check_topk_inputs(x, k)
    return torch.ops.rt.topk(x, k)


def topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `rt::topk` (same arguments, same result bit for bit)."""
    values, columns = x.sort(dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), columns[..., :k].contiguous()


@_topk_op.register_kernel("cpu")
def _topk_cpu(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the CPU: the reference."""
    return topk_ref(x, k)
