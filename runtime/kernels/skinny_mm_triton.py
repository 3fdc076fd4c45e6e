"""The Triton kernel of `rt::skinny_mm`, its launcher and its tiling per shape; the product
tile (`skinny_mm_tile`) that the ops built on it share, with its optional input prologue
(`NormPrologue`: the residual add and RMSNorm of `rt::add_rms_norm_mm`, rms_norm_mm.py).

Imported only where Triton is installed, by the ops' CUDA paths (and by the TRITON_INTERPRET
tests and `specrun bench skinny-mm`): skinny_mm.py states the method and holds the reference
that every other caller runs.
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
# Rows of w at least this long stream from memory at bandwidth (Llama-3.1-8B's 4096 and
# 14,336); shorter ones (a small model's hidden size) are bound by each program's latency.
_LONG_ROW = 1536
# One row of x: below this many columns, narrower programs read longer steps.
_ONE_ROW_LONG = 2048
# Entries of the [rows, columns] tile a NormPrologue reads its rows' squares in.
_NORM_TILE = 16384


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

    def block_m(self, num_rows: int) -> int:
        """The rows of x a program's tile holds for `num_rows` rows: 16, 32 or 64 on the
        tensor cores, 1 elementwise (which multiplies one row only)."""
        if self.use_dot:
            return dot_rows(num_rows)
        if num_rows > 1:
            raise ValueError(f"{self} multiplies one row of x; got {num_rows}")
        return 1


@dataclass(frozen=True)
class NormPrologue:
    """A product's input built in its own programs (`rt::add_rms_norm_mm`): h = x + delta,
    rounded to x's dtype and written to `h` by program 0, then RMS-normalised in float32 with
    `eps`, rounded, scaled by `weight` and rounded again (models/llama.py's RMSNorm)."""

    delta: torch.Tensor  # [M, K] in x's dtype, rows contiguous
    weight: torch.Tensor  # [K] in x's dtype
    eps: float
    h: torch.Tensor  # [M, K] in x's dtype, contiguous: written


@triton.jit
def _residual_sum(x_ptr, d_ptr, rows_m, ks, ok, stride_xm, stride_xk, stride_dm):
    """(x + delta)[rows_m, ks] rounded to x's dtype (0 where not ok)."""
    x = tl.load(x_ptr + rows_m[:, None] * stride_xm + ks[None, :] * stride_xk, mask=ok, other=0.0)
    d = tl.load(d_ptr + rows_m[:, None] * stride_dm + ks[None, :], mask=ok, other=0.0)
    return (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)


@triton.jit
def _norm_rstd(
    x_ptr, d_ptr, M, K, stride_xm, stride_xk, stride_dm, eps,
    BLOCK_M: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
):  # fmt: skip
    """1 / sqrt(mean((x + delta)^2) + eps) per row, [BLOCK_M] float32: each program reads the
    rows whole before its K loop (short rows: one or two steps of NORM_BLOCK_K columns)."""
    rows_m = tl.arange(0, BLOCK_M)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    for k in range(0, K, NORM_BLOCK_K):
        ks = k + tl.arange(0, NORM_BLOCK_K)
        ok = (rows_m[:, None] < M) & (ks[None, :] < K)
        h = _residual_sum(x_ptr, d_ptr, rows_m, ks, ok, stride_xm, stride_xk, stride_dm)
        h = h.to(tl.float32)
        squares += tl.sum(h * h, 1)
    return tl.rsqrt(squares / K + eps)


@triton.jit
def _normed(x, d_ptr, nw_ptr, h_ptr, rows_m, ks, ok, K, stride_dm, rstd, h_rows):
    """The normalised input tile for x's tile [BLOCK_M, BLOCK_K] (NormPrologue's roundings);
    stores x + delta for the first h_rows rows."""
    d = tl.load(d_ptr + rows_m[:, None] * stride_dm + ks[None, :], mask=ok, other=0.0)
    h = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + rows_m[:, None] * K + ks[None, :], h, mask=ok & (rows_m[:, None] < h_rows))
    scale = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    normed = (h.to(tl.float32) * rstd[:, None]).to(x.dtype)
    return (scale[None, :] * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def skinny_mm_tile(
    x_ptr, w_ptr, rows_n, rows_ok, M, K, stride_xm, stride_xk, stride_wn, stride_wk,
    d_ptr, nw_ptr, h_ptr, stride_dm, eps, h_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NORM: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x[:M] @ w[rows_n]^T as a float32 [BLOCK_M, BLOCK_N] tile, for the BLOCK_N rows of w
    `rows_n` names (rows past M, and rows of w where `rows_ok` is False, hold 0): the product
    every kernel built on `rt::skinny_mm` shares. With NORM the input is NormPrologue's
    (delta at d_ptr, the norm's weight at nw_ptr, the first h_rows rows of x + delta stored
    at h_ptr: M in one program, 0 in the others); without it those arguments are unused."""
    rows_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    n_ok = rows_ok[:, None]
    m_ok = rows_m[:, None] < M
    w_rows = w_ptr + rows_n[:, None] * stride_wn
    if NORM:
        rstd = _norm_rstd(x_ptr, d_ptr, M, K, stride_xm, stride_xk, stride_dm, eps, BLOCK_M,
                          NORM_BLOCK_K)  # fmt: skip
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + cols
        # Without a column mask on whole blocks the loads stay 16-byte vectors.
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok, other=0.0)
            x_ok = m_ok
        else:
            k_ok = ks[None, :] < K
            w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok & k_ok, other=0.0)
            x_ok = m_ok & k_ok
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + ks[None, :] * stride_xk, mask=x_ok,
                    other=0.0)  # fmt: skip
        if NORM:
            x = _normed(x, d_ptr, nw_ptr, h_ptr, rows_m, ks, x_ok, K, stride_dm, rstd, h_rows)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return tl.sum(acc, 1)[None, :] if BLOCK_M == 1 else acc


@triton.jit
def _skinny_mm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    d_ptr, nw_ptr, h_ptr, stride_dm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NORM: tl.constexpr, NORM_BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[:M, n-block] = x[:M] @ w[n-block]^T, summed in float32 (x NormPrologue's with
    NORM)."""
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    sums = skinny_mm_tile(x_ptr, w_ptr, rows_n, rows_n < N, M, K, stride_xm, stride_xk,
                          stride_wn, stride_wk, d_ptr, nw_ptr, h_ptr, stride_dm, eps,
                          tl.where(tl.program_id(0) == 0, M, 0), BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_K, NORM, NORM_BLOCK_K)  # fmt: skip
    rows_m = tl.arange(0, BLOCK_M)
    out_ptrs = out_ptr + rows_m[:, None] * stride_om + rows_n[None, :]
    ok = (rows_m[:, None] < M) & (rows_n[None, :] < N)
    tl.store(out_ptrs, sums.to(out_ptr.dtype.element_ty), mask=ok)


def norm_prologue_args(x: torch.Tensor, norm: NormPrologue | None, *, block_m: int) -> dict:
    """The kernels' NormPrologue arguments (unused placeholders without one)."""
    if norm is None:
        return dict(d_ptr=x, nw_ptr=x, h_ptr=x, stride_dm=0, eps=0.0, NORM=False, NORM_BLOCK_K=16)
    norm_block_k = min(triton.next_power_of_2(x.shape[1]), _NORM_TILE // block_m)
    return dict(
        d_ptr=norm.delta, nw_ptr=norm.weight, h_ptr=norm.h, stride_dm=norm.delta.stride(0),
        eps=norm.eps, NORM=True, NORM_BLOCK_K=norm_block_k,
    )  # fmt: skip


def launch_skinny_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    config: SkinnyMMConfig | None = None,
    norm: NormPrologue | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (inputs as skinny_mm.check_skinny_mm_inputs
    allows), with `config` or the tiling `skinny_mm_config` picks; with `norm`, the product of
    its normalised x + delta (rms_norm_mm.py)."""
    num_rows, k = x.shape
    n = w.shape[0]
    if config is None:
        config = skinny_mm_config(num_rows, n, k)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    block_m = config.block_m(num_rows)
    wrap(_skinny_mm_kernel)[(triton.cdiv(n, config.block_n),)](
        x, w, out, num_rows, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        out.stride(0), **norm_prologue_args(x, norm, block_m=block_m),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def dot_rows(num_rows: int) -> int:
    """The rows of x a tensor-core tile holds for `num_rows` rows: 16, 32 or 64."""
    return max(_DOT_ROWS, 1 << (num_rows - 1).bit_length())


def skinny_mm_config(num_rows: int, n: int, k: int) -> SkinnyMMConfig:
    """The tiling for x [num_rows, k] @ w [n, k]^T, fitted to `specrun bench skinny-mm --sweep`
    (BENCHMARKS.md).

    Long rows (k >= 1536; Llama-3.1-8B's weights, on an H100): one row of x takes 8 rows of w
    per program, 512 columns a step, elementwise. 2-16 rows take tensor-core tiles of 256
    columns and 64 rows of w where N >= 6144 (16 below: N = 4096 then still has 256
    programs); 17-64 rows re-read x in every program, so programs take wider slices of w once
    N leaves enough of them (32 rows of w from N = 3072, 64 from 6144) and steps of 256
    columns.

    Short rows (a small model's: SmolLM2-135M's 576 and 1536 columns, on an H200) are bound by
    each program's latency, not bandwidth. One row of x (k < 2048): 4 rows of w a program, 2
    warps, steps of 1024 columns (576 in one masked step instead of two of 512; 256 for a
    vocabulary-sized N >= 6144, whose 4-row programs are many). 2-64 rows (k < 1536): steps of
    64 columns (576 is no multiple of 128 or 256, so wider steps mask their last) over 16 rows
    of w, 32 from N = 3072 and 64 from 6144, up to 5 stages (3 for a vocabulary).

    Pipeline stages are as many as fit _STAGE_BUDGET_BYTES of shared memory, up to the
    fitted maximum."""
    if num_rows == 1:
        if k < _ONE_ROW_LONG:
            block_k = 1024 if n < 6144 else 256
            num_stages = 1 if block_k >= k else 3
            return SkinnyMMConfig(block_n=4, block_k=block_k, num_warps=2, num_stages=num_stages)
        return SkinnyMMConfig(block_n=8, block_k=512, num_warps=4, num_stages=3)
    block_n = 64 if n >= 6144 else 32 if n >= 3072 else 16
    if k < _LONG_ROW:
        block_k, max_stages = 64, (3 if n >= 6144 else 5)
    elif num_rows <= _DOT_ROWS:
        block_n, block_k, max_stages = (64 if n >= 6144 else 16), 256, 5
    else:
        block_k, max_stages = 256, 4
    stage_bytes = (dot_rows(num_rows) + block_n) * block_k * 2
    return SkinnyMMConfig(
        block_n=block_n,
        block_k=block_k,
        num_warps=4,
        num_stages=min(max_stages, _STAGE_BUDGET_BYTES // stage_bytes),
        use_dot=True,
    )
