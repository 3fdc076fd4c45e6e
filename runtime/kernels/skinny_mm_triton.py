"""The Triton kernel of `rt::skinny_mm`, its launcher and its tiling per shape.

Imported only where Triton is installed, by the op's CUDA path in skinny_mm.py (and by the
TRITON_INTERPRET tests and `specrun bench skinny-mm`): skinny_mm.py states the method and holds
the reference that every other caller runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton import wrap

_DOT_ROWS = 16  # tl.dot's smallest M
# Shared memory the pipelined x and w tiles may take (of the H100's 227 KB a block).
_STAGE_BUDGET_BYTES = 200 * 1024


@dataclass(frozen=True)
class SkinnyMMConfig:
    """One tiling: each program streams `block_n` rows of w, `block_k` columns per step.
    `use_dot` multiplies on the tensor cores (x padded to 16, 32 or 64 rows); without it, only
    one row of x is allowed."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = False


@triton.jit
def _skinny_mm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[:M, n-block] = x[:M] @ w[n-block]^T, summed in float32."""
    pid_n = tl.program_id(0)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    n_ok = rows_n[:, None] < N
    m_ok = rows_m[:, None] < M
    w_rows = w_ptr + rows_n[:, None] * stride_wn
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + cols
        # Without a column mask on whole blocks the loads stay 16-byte vectors.
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok, other=0.0)
        else:
            k_ok = ks[None, :] < K
            w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok & k_ok, other=0.0)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xm + ks[None, :] * stride_xk
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok & (ks[None, :] < K), other=0.0)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    sums = tl.sum(acc, 1)[None, :] if BLOCK_M == 1 else acc
    out_ptrs = out_ptr + rows_m[:, None] * stride_om + rows_n[None, :]
    tl.store(out_ptrs, sums.to(out_ptr.dtype.element_ty), mask=m_ok & (rows_n[None, :] < N))


def launch_skinny_mm(
    x: torch.Tensor, w: torch.Tensor, *, config: SkinnyMMConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (inputs as skinny_mm.check_skinny_mm_inputs
    allows), with `config` or the tiling `skinny_mm_config` picks."""
    num_rows, k = x.shape
    n = w.shape[0]
    if config is None:
        config = skinny_mm_config(num_rows, n, k)
    if num_rows > 1 and not config.use_dot:
        raise ValueError(f"{config} multiplies one row of x; got {num_rows}")
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n),)
    wrap(_skinny_mm_kernel)[grid](
        x,
        w,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        BLOCK_M=dot_rows(num_rows) if config.use_dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def dot_rows(num_rows: int) -> int:
    """The rows of x a tensor-core tile holds for `num_rows` rows: 16, 32 or 64."""
    return max(_DOT_ROWS, 1 << (num_rows - 1).bit_length())


def skinny_mm_config(num_rows: int, n: int, k: int) -> SkinnyMMConfig:
    """The tiling for x [num_rows, k] @ w [n, k]^T, fitted to `specrun bench skinny-mm --sweep`
    on an H100 (BENCHMARKS.md). One row takes 8 rows of w per program, 512 columns a step,
    elementwise. 2-16 rows (fitted to Llama-3.1-8B's weights) take tensor-core tiles of 256
    columns and 64 rows of w where N >= 6144 (16 below: N = 4096 then still has 256
    programs). 17-64 rows (a tree's verification, a large bucket; fitted to SmolLM2-135M's
    and the 8B's weights) re-read x in every program, so programs take wider slices of w
    once N leaves enough of them (32 rows of w from N = 3072, 64 from 6144) and shorter
    steps where K is short (128 columns; 64 for a vocabulary-sized N). Pipeline stages are
    as many as fit _STAGE_BUDGET_BYTES of shared memory, up to the fitted maximum."""
    if num_rows == 1:
        return SkinnyMMConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)
    if num_rows <= _DOT_ROWS:
        block_n, block_k, max_stages = (64 if n >= 6144 else 16), 256, 5
    else:
        block_n = 64 if n >= 6144 else 32 if n >= 3072 else 16
        if k >= 1536:
            block_k, max_stages = 256, 4
        elif n >= 6144:  # a small model's vocabulary: many programs, each re-reading all of x
            block_k, max_stages = 64, 3
        else:
            block_k, max_stages = 128, 4
    stage_bytes = (dot_rows(num_rows) + block_n) * block_k * 2
    return SkinnyMMConfig(
        block_n=block_n,
        block_k=block_k,
        num_warps=4,
        num_stages=min(max_stages, _STAGE_BUDGET_BYTES // stage_bytes),
        use_dot=True,
    )
