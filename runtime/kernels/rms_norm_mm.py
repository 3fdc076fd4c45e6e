"""`rt::add_rms_norm_mm` and `rt::add_rms_norm_mm_silu_mul`: a residual add and the RMSNorm
that follows it, computed by the few-row product that reads the norm.

A pre-norm decoder layer adds each sublayer's output to the residual stream and normalises the
sum for the next product: h = x + delta; normed = weight * rms_norm(h); then normed @ w.T
(attention's qkv projection, or the MLP's gate/up one). For a few rows the add and norm are one
element-wise launch bound by latency, between two products that are too. Here every program
of the product (`rt::skinny_mm`'s tile code, skinny_mm_triton.skinny_mm_tile with its
NormPrologue) reads the rows of x and delta whole to get each row's 1 / rms, then builds its
input tiles in the K loop: x + delta rounded to x's dtype, times 1 / rms in float32 rounded,
times the norm's weight rounded (models/llama.py's RMSNorm, the eager roundings); program 0
also writes h, which the residual stream goes on with. `..._silu_mul` is the same prologue on
`rt::mm_silu_mul`.

Every program re-reads x and delta: [M, K] each, from L2, so this pays for a small model's
short rows; the FX pass in runtime/passes/rms_norm_mm.py puts the ops in compiled graphs for
rows of fewer than 2048 columns.

The kernels live in skinny_mm_triton.py and mm_silu_mul_triton.py, imported at the first
launch, so this module loads without Triton, where the ops run the references on every device
(see _triton.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._triton import rt_op, uses_triton
from .mm_silu_mul import check_mm_silu_mul_inputs, mm_silu_mul_ref
from .skinny_mm import check_skinny_mm_inputs, skinny_mm_ref

_OP_MM = "rt::add_rms_norm_mm"
_OP_SILU_MUL = "rt::add_rms_norm_mm_silu_mul"


def check_add_rms_norm_inputs(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, op: str
) -> None:
    """Raise ValueError unless `op` takes the prologue's x, delta, weight and eps (the
    product's checks are the caller's)."""
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"{op} takes delta of x's shape and dtype {tuple(x.shape)} {x.dtype}, got "
            f"{tuple(delta.shape)} {delta.dtype}"
        )
    if delta.stride(-1) != 1:
        raise ValueError(f"{op} takes delta with contiguous rows, got strides {delta.stride()}")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"{op} takes a norm weight [{x.shape[-1]}] in {x.dtype}, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    if not eps >= 0.0:
        raise ValueError(f"{op} takes eps >= 0, got {eps}")


def add_rms_norm_mm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + delta)) @ w.T for few rows (`rt::add_rms_norm_mm`), the normed
    rows never stored, and x + delta.

    Args:
        x: [M, K] float16 or bfloat16, 1 <= M <= skinny_mm.MAX_ROWS, any strides.
        delta: [M, K] in x's dtype, rows contiguous.
        weight: [K] in x's dtype (the RMSNorm's).
        w: [N, K] in x's dtype (a Linear's weight), any strides.
        eps: the RMSNorm's epsilon, >= 0.
    Returns:
        the product [M, N] and x + delta [M, K], in x's dtype, contiguous.
    Raises:
        ValueError: for other ranks, dtypes, shapes, row counts or eps.
    """
    return torch.ops.rt.add_rms_norm_mm(x, delta, weight, w, eps)


def add_rms_norm_mm_silu_mul(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rt::mm_silu_mul` of weight * rms_norm(x + delta) (`rt::add_rms_norm_mm_silu_mul`), and
    x + delta.

    Args:
        x, delta, weight, eps: as `add_rms_norm_mm`'s.
        w: [2I, K] in x's dtype: the gate's I rows, then the up projection's.
    Returns:
        SiLU(gate) * up [M, I] and x + delta [M, K], in x's dtype, contiguous.
    Raises:
        ValueError: as `add_rms_norm_mm`, and for an odd 2I.
    """
    return torch.ops.rt.add_rms_norm_mm_silu_mul(x, delta, weight, w, eps)


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch prologue: (x + delta, weight * rms_norm(x + delta)), as models/llama.py
    computes them."""
    h = x + delta
    return h, weight * F.rms_norm(h, (h.shape[-1],), eps=eps)


def add_rms_norm_mm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `rt::add_rms_norm_mm`: the prologue's reference, then `rt::skinny_mm`'s."""
    h, normed = add_rms_norm_ref(x, delta, weight, eps)
    return skinny_mm_ref(normed, w), h


def add_rms_norm_mm_silu_mul_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `rt::add_rms_norm_mm_silu_mul`: the prologue's reference, then
    `rt::mm_silu_mul`'s."""
    h, normed = add_rms_norm_ref(x, delta, weight, eps)
    return mm_silu_mul_ref(normed, w), h


def _launch(x, delta, weight, w, eps, *, silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # Imported here, not at the top: this module must load where Triton is missing.
    from .mm_silu_mul_triton import launch_mm_silu_mul
    from .skinny_mm_triton import NormPrologue, launch_skinny_mm

    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    norm = NormPrologue(delta=delta, weight=weight, eps=eps, h=h)
    launch = launch_mm_silu_mul if silu_mul else launch_skinny_mm
    return launch(x, w, norm=norm), h


def _define_op(name: str, reference: Callable[..., Any], *, silu_mul: bool) -> None:
    """Define the op `name`: the product kernel with its prologue on CUDA with Triton,
    `reference` elsewhere and as the CPU kernel."""

    def check(x, delta, weight, w, eps) -> None:
        if silu_mul:
            check_mm_silu_mul_inputs(x, w)
        else:
            check_skinny_mm_inputs(x, w, op=name)
        check_add_rms_norm_inputs(x, delta, weight, eps, op=name)

    def body(
        x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check(x, delta, weight, w, eps)
        if not uses_triton(x.device):
            return reference(x, delta, weight, w, eps)
        return _launch(x, delta, weight, w, eps, silu_mul=silu_mul)

    def on_cpu(x, delta, weight, w, eps):
        check(x, delta, weight, w, eps)
        return reference(x, delta, weight, w, eps)

    rt_op(name)(body).register_kernel("cpu")(on_cpu)


_define_op(_OP_MM, add_rms_norm_mm_ref, silu_mul=False)
_define_op(_OP_SILU_MUL, add_rms_norm_mm_silu_mul_ref, silu_mul=True)
