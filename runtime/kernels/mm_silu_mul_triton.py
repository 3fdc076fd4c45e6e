"""The Triton kernel of `rt::mm_silu_mul` and its launcher.

Imported only where Triton is installed, by the op's CUDA path in mm_silu_mul.py (and by the
TRITON_INTERPRET tests): mm_silu_mul.py states the method and holds the reference.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ._triton import wrap
from .skinny_mm_triton import (
    NormPrologue,
    SkinnyMMConfig,
    norm_prologue_args,
    skinny_mm_config,
    skinny_mm_tile,
)


@triton.jit
def _mm_silu_mul_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    d_ptr, nw_ptr, h_ptr, stride_dm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NORM: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[:M, n-block] = SiLU(x @ gate[n-block]^T) * (x @ up[n-block]^T) for n-blocks of
    BLOCK_N // 2 columns, where w holds the gate's N rows and then the up projection's. One
    product tile over both halves' rows (one K loop, as the unfused product's programs run);
    both halves rounded to x's dtype, SiLU in float32 rounded, their product rounded again
    (the unfused graph's roundings). x is NormPrologue's with NORM."""
    HALF: tl.constexpr = BLOCK_N // 2
    columns = tl.program_id(0) * HALF + tl.arange(0, HALF)
    # Tile rows [0, HALF) are gate rows, [HALF, BLOCK_N) the matching up rows.
    lanes = tl.arange(0, BLOCK_N)
    half_lanes = tl.program_id(0) * HALF + (lanes % HALF)
    rows_n = tl.where(lanes < HALF, half_lanes, N + half_lanes)
    sums = skinny_mm_tile(x_ptr, w_ptr, rows_n, half_lanes < N, M, K, stride_xm, stride_xk,
                          stride_wn, stride_wk, d_ptr, nw_ptr, h_ptr, stride_dm, eps,
                          tl.where(tl.program_id(0) == 0, M, 0), BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_K, NORM, NORM_BLOCK_K)  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    sums = sums.to(dtype).to(tl.float32)
    # [rows, 2, HALF] -> [rows, HALF, 2]: split the halves apart.
    gate, up = tl.split(tl.permute(tl.reshape(sums, (sums.shape[0], 2, HALF)), (0, 2, 1)))
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    out = (silu.to(tl.float32) * up).to(dtype)
    rows_m = tl.arange(0, sums.shape[0])
    ok = (rows_m[:, None] < M) & (columns[None, :] < N)
    tl.store(out_ptr + rows_m[:, None] * stride_om + columns[None, :], out, mask=ok)


def mm_silu_mul_config(num_rows: int, intermediate: int, k: int) -> SkinnyMMConfig:
    """The tiling: `rt::skinny_mm`'s for the whole [2I, K] product (each program's rows half
    gate, half up: as many programs and bytes as the unfused product), with at least 2 rows
    of w a program."""
    config = skinny_mm_config(num_rows, 2 * intermediate, k)
    return replace(config, block_n=max(2, config.block_n))


def launch_mm_silu_mul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    config: SkinnyMMConfig | None = None,
    norm: NormPrologue | None = None,
) -> torch.Tensor:
    """Run the kernel on x [M, K] and w [2I, K] (inputs as mm_silu_mul.check_mm_silu_mul_inputs
    allows; with `norm`, on its normalised x + delta). Returns [M, I] in x's dtype."""
    num_rows, k = x.shape
    intermediate = w.shape[0] // 2
    if config is None:
        config = mm_silu_mul_config(num_rows, intermediate, k)
    out = torch.empty((num_rows, intermediate), dtype=x.dtype, device=x.device)
    block_m = config.block_m(num_rows)
    wrap(_mm_silu_mul_kernel)[(triton.cdiv(intermediate, config.block_n // 2),)](
        x, w, out, num_rows, intermediate, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        out.stride(0), **norm_prologue_args(x, norm, block_m=block_m),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
