"""`rt::mm_silu_mul`: a SwiGLU MLP's gate/up product with SiLU(gate) * up as its epilogue.

Every decoder layer multiplies its normed rows by the fused gate/up weight ([2I, H]: the gate's
I rows, then the up projection's) and hands the [M, 2I] product to one element-wise kernel,
SiLU(gate) * up, which the down projection reads. For a few rows both launches are bound by
latency, and the [M, 2I] product makes a round trip through memory. Here program n multiplies
x by the gate's n-th block of rows and by the up projection's matching block (the same tile
code as `rt::skinny_mm`, skinny_mm_triton.skinny_mm_tile), rounds both to x's dtype as the
product would be stored, and writes SiLU(gate) * up, [M, I], computed as the compiled graph
computes it: SiLU in float32 rounded to x's dtype, then the product rounded again.

The FX pass in runtime/passes/mm_silu_mul.py puts the op in compiled graphs where an
`rt::skinny_mm` product's only use is that SiLU and multiply.

The kernel lives in mm_silu_mul_triton.py, imported at the first launch, so this module loads
without Triton, where the op runs the reference on every device (see _triton.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import rt_op, uses_triton
from .skinny_mm import check_skinny_mm_inputs, skinny_mm_ref

_OP = "rt::mm_silu_mul"


def check_mm_silu_mul_inputs(x: torch.Tensor, w: torch.Tensor) -> None:
    """Raise ValueError unless `rt::mm_silu_mul` takes (x, w)."""
    check_skinny_mm_inputs(x, w, op=_OP)
    if w.shape[0] % 2:
        raise ValueError(f"{_OP} takes w [2I, K] (gate rows, then up rows), got {w.shape[0]} rows")


@rt_op(_OP)
def _mm_silu_mul_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    check_mm_silu_mul_inputs(x, w)
    if not uses_triton(x.device):
        return mm_silu_mul_ref(x, w)
    # Imported here, not at the top: this module must load where Triton is missing.
    from .mm_silu_mul_triton import launch_mm_silu_mul

    return launch_mm_silu_mul(x, w)


def mm_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ w[:I].T) * (x @ w[I:].T) for few rows of x (`rt::mm_silu_mul`), the product
    never stored.

    Args:
        x: [M, K] float16 or bfloat16, 1 <= M <= skinny_mm.MAX_ROWS, any strides.
        w: [2I, K] in x's dtype: the gate's I rows, then the up projection's; any strides.
    Returns:
        [M, I] in x's dtype, contiguous.
    Raises:
        ValueError: for other ranks, dtypes, row counts, mismatched K or an odd 2I.
    """
    return torch.ops.rt.mm_silu_mul(x, w)


def mm_silu_mul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `rt::mm_silu_mul`: `rt::skinny_mm`'s reference, split in halves, SiLU of
    the first (float32, rounded to x's dtype) times the second."""
    gate, up = skinny_mm_ref(x, w).chunk(2, dim=-1)
    return F.silu(gate.float()).to(x.dtype) * up


@_mm_silu_mul_op.register_kernel("cpu")
def _mm_silu_mul_cpu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op on the CPU: the reference."""
    check_mm_silu_mul_inputs(x, w)
    return mm_silu_mul_ref(x, w)
