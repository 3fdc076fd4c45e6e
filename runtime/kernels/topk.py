"""`rt::topk` and `rt::log_softmax_topk`: the k largest entries of each row for small k, in Triton.

The draft picks a handful of children from each frontier node's distribution over the draft
vocabulary: topk with k <= 16 over [B * K, V] rows. ATen's topk runs a multi-pass radix
select per row, about 40 us on an H100 for [8, 8192] (a 135M target's plain step is 1.5 ms),
and a round drafting 5 levels would pay that five times. Here a program holds one chunk of a row
in registers as int64 keys, (value, column) packed so that one max-reduction picks the best
value and, among equal values, the lowest column; it takes the maximum k times, removing
each winner, or (for the draft vocabulary's few rows, where it is faster) selects its k by
one bitonic top-k of the same keys:

- grid (rows, chunks); each chunk of at most `MAX_CHUNK` columns (the width `topk_config`
  picks in topk_triton.py) gives its own top k, best first: the row's answer where it has
  one chunk;
- with more chunks, each stores its k as keys, and the row's last chunk to finish (counted
  in arrival counters, arrivals.py) selects the row's k from its chunks * k keys, in the same
  launch.

Order is defined exactly, unlike ATen's: values descending, equal values by ascending column,
so the kernel and `topk_ref` (a stable descending sort, cut at k) agree bit for bit. -inf
entries are ordinary values; rows must not hold NaN (log-probabilities never do).

`rt::log_softmax_topk` is the draft's "top k children and their log-probabilities": the same
selection on the logits (log-softmax keeps each row's order), reported as float32 logits
minus the row's log-sum-exp. Each program also reduces its chunk to (max, sum of exp(x -
max)); the row's last chunk combines them and subtracts. One launch replaces a log-softmax
kernel, its float32 [rows, V] round trip and the topk.

The kernels live in topk_triton.py, imported at the first launch, so this module loads without
Triton, where the ops run their references on every device (see _triton.py).
"""

from __future__ import annotations

import torch

from ._triton import rt_op, uses_triton

MAX_K = 64
MAX_CHUNK = 2048


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
    """The Triton kernels (topk_triton.launch_topk) over x [..., V] viewed as rows; outputs
    shaped [..., k]."""
    # Imported here, not at the top: this module must load where Triton is missing.
    from .topk_triton import launch_topk

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    values, columns = launch_topk(rows, k, log_softmax=log_softmax)
    shape = (*x.shape[:-1], k)
    return values.view(shape), columns.view(shape)


def _topk_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(x, k)
    return topk_ref(x, k)


def _log_softmax_topk_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(x, k, op="rt::log_softmax_topk")
    return log_softmax_topk_ref(x, k)


# The ops stay opaque in compiled graphs (their references as fake impls): a row's chunks are
# merged by the last chunk to finish, counted in arrival counters that live across launches
# (arrivals.py), which the launcher must find at run time. Non-CUDA tensors, and any tensors
# without Triton, take the reference.


@rt_op("rt::topk", opaque_with=_topk_fake)
def _topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(x, k)
    if not uses_triton(x.device):
        return topk_ref(x, k)
    return _launch_on_rows(x, k, log_softmax=False)


@rt_op("rt::log_softmax_topk", opaque_with=_log_softmax_topk_fake)
def _log_softmax_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_topk_inputs(x, k, op="rt::log_softmax_topk")
    # float64 rows (reference models in tests) would lose order in the kernel's float32 keys.
    if not uses_triton(x.device) or x.dtype == torch.float64:
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
