"""`rt::skinny_mm`: x @ w.T for a few rows of x, the decode step's matrix products, in Triton.

A decode step multiplies a handful of activation rows (one per slot, or per tree node) by every
weight matrix of the model: [M, K] @ [N, K]^T with M <= 64 and N * K in the millions. That is a
stream of the weights through the GPU with almost no arithmetic, and its speed is the read
bandwidth it reaches. cuBLAS picks GEMM tilings made for large M; at batch 1 a Llama-3.1-8B
step read its weights at about 2.5 TB/s on an H100 that copies at about 3.0. Here a program
owns `block_n` rows of w and streams them once, `block_k` columns at a time, with enough
programs and loads in flight to keep the memory system busy:

- one row of x (`M == 1`): the products are accumulated elementwise in a [block_n, block_k]
  float32 tile and reduced once at the end (no tensor cores: there is one row to multiply);
- 2-64 rows (a batch's slots, a tree's nodes in verification): `tl.dot` on x padded to 16,
  32 or 64 rows, w's tile transposed in shared memory.

Splitting K across programs (float32 partial sums added by a second kernel) never won on
Llama-3.1-8B's shapes, whose N already gives every multiprocessor programs, so there is none.

`skinny_mm_config` (skinny_mm_triton.py) picks the tiling per shape from measurements
(`specrun bench skinny-mm`). The result matches `skinny_mm_ref` to float32 accumulation order
(both accumulate in float32 and round once). The FX pass in runtime/passes/skinny_mm.py puts
the op in compiled graphs in place of ATen's mm where M is small and static.

The kernels live in skinny_mm_triton.py, imported at the first launch, so this module loads
without Triton, where the op runs the reference on every device (see _triton.py).
"""

from __future__ import annotations

import torch

from ._triton import rt_op, uses_triton

MAX_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16)
_MAX_OFFSET = 2**31 - 1  # the kernel addresses its operands with 32-bit element offsets


def within_offset_range(t: torch.Tensor) -> bool:
    """Whether every element of the 2-D `t` lies within 32-bit offsets of its first."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return last <= _MAX_OFFSET


def check_skinny_mm_inputs(x: torch.Tensor, w: torch.Tensor, *, op: str = "rt::skinny_mm") -> None:
    """Raise ValueError unless `op` (rt::skinny_mm or an op built on its product) takes
    x [M, K] and w [N, K]."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"{op} takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"{op} takes float16 or bfloat16 x and w of one dtype, got {x.dtype} and {w.dtype}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{op} takes 1 to {MAX_ROWS} rows of x, got {x.shape[0]}")
    if x.shape[1] != w.shape[1] or x.shape[1] == 0 or w.shape[0] == 0:
        raise ValueError(
            f"{op}: x [M, K] and w [N, K] need one K > 0 and N > 0, got {tuple(x.shape)} and "
            f"{tuple(w.shape)}"
        )
    if not (within_offset_range(x) and within_offset_range(w)):
        raise ValueError(
            f"{op} takes operands of fewer than 2**31 elements (by their strides), got "
            f"w {tuple(w.shape)} with strides {w.stride()}; use torch.mm for larger ones"
        )


@rt_op("rt::skinny_mm")
def _skinny_mm_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    check_skinny_mm_inputs(x, w)
    if not uses_triton(x.device):
        return skinny_mm_ref(x, w)
    # Imported here, not at the top: this module must load where Triton is missing.
    from .skinny_mm_triton import launch_skinny_mm

    return launch_skinny_mm(x, w)


def skinny_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for few rows of x (`rt::skinny_mm`), accumulated in float32.

    Args:
        x: [M, K] float16 or bfloat16, 1 <= M <= MAX_ROWS, any strides.
        w: [N, K] in x's dtype (a Linear's weight), any strides.
    Returns:
        [M, N] in x's dtype, contiguous.
    Raises:
        ValueError: for other ranks, dtypes, row counts or mismatched K.
    """
    return torch.ops.rt.skinny_mm(x, w)


def skinny_mm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `rt::skinny_mm`: the product in float32, rounded once to x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)


@_skinny_mm_op.register_kernel("cpu")
def _skinny_mm_cpu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op on the CPU: the reference."""
    check_skinny_mm_inputs(x, w)
    return skinny_mm_ref(x, w)
