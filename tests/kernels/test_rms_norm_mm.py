"""rt::add_rms_norm_mm and rt::add_rms_norm_mm_silu_mul against the residual add, the model's
RMSNorm and the product.

CPU tier: the prologue's reference against models/llama.py's RMSNorm, the ops on
hypothesis-drawn shapes, their argument checks, opcheck, and the Triton kernels with the
prologue under TRITON_INTERPRET=1 (in a subprocess; float16) and compiled for sm_90. GPU tier
(`-m gpu`): the kernels at SmolLM2's shapes and odd ones.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import assert_script_passes_under_interpreter, compile_for_hopper

from specrun.models.llama import RMSNorm
from specrun.runtime.kernels.mm_silu_mul import mm_silu_mul_ref
from specrun.runtime.kernels.rms_norm_mm import (
    add_rms_norm_mm,
    add_rms_norm_mm_ref,
    add_rms_norm_mm_silu_mul,
    add_rms_norm_mm_silu_mul_ref,
    add_rms_norm_ref,
)
from specrun.runtime.kernels.skinny_mm import MAX_ROWS, skinny_mm_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EPS = 1e-5


def make_operands(num_rows, n, depth, *, dtype, seed, device="cpu"):
    """x, delta [rows, depth], the norm's weight [depth] and w [n, depth]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, depth, generator=gen)
    delta = torch.randn(num_rows, depth, generator=gen)
    weight = 1.0 + 0.1 * torch.randn(depth, generator=gen)
    w = torch.randn(n, depth, generator=gen) * depth**-0.5
    return tuple(t.to(dtype).to(device) for t in (x, delta, weight, w))


def test_prologue_reference_is_the_models_residual_add_and_norm():
    x, delta, weight, _ = make_operands(5, 1, 96, dtype=torch.bfloat16, seed=0)
    norm = RMSNorm(96, EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
        h, normed = add_rms_norm_ref(x, delta, weight, EPS)
        assert torch.equal(h, x + delta)
        assert torch.equal(normed, norm(x + delta))


@settings(max_examples=25, deadline=None)
@given(
    num_rows=st.integers(1, MAX_ROWS),
    n=st.integers(1, 150),
    depth=st.integers(1, 96),
    silu_mul=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_ops_are_the_product_of_the_normed_sum(num_rows, n, depth, silu_mul, dtype, seed):
    x, delta, weight, w = make_operands(num_rows, 2 * n, depth, dtype=dtype, seed=seed)
    op = add_rms_norm_mm_silu_mul if silu_mul else add_rms_norm_mm
    out, h = op(x, delta, weight, w, EPS)
    h_want, normed = add_rms_norm_ref(x, delta, weight, EPS)
    want = mm_silu_mul_ref(normed, w) if silu_mul else skinny_mm_ref(normed, w)
    assert torch.equal(h, h_want) and torch.equal(out, want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("delta_shape", "delta of x's shape"),
        ("delta_strided", "contiguous rows"),
        ("weight_shape", "norm weight"),
        ("weight_dtype", "norm weight"),
        ("eps", "eps >= 0"),
        ("w_depth", "need one K"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    x, delta, weight, w = make_operands(3, 8, 16, dtype=torch.bfloat16, seed=0)
    eps = EPS
    if change == "delta_shape":
        delta = delta[:2]
    elif change == "delta_strided":
        delta = torch.zeros(16, 3, dtype=x.dtype).T
    elif change == "weight_shape":
        weight = weight[:15]
    elif change == "weight_dtype":
        weight = weight.float()
    elif change == "eps":
        eps = -1.0
    elif change == "w_depth":
        w = w[:, :15]
    with pytest.raises(ValueError, match=message):
        add_rms_norm_mm(x, delta, weight, w, eps)


def test_silu_mul_refuses_an_odd_number_of_rows_of_w():
    x, delta, weight, w = make_operands(2, 7, 16, dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="2I"):
        add_rms_norm_mm_silu_mul(x, delta, weight, w, EPS)


@pytest.mark.parametrize("op", ["add_rms_norm_mm", "add_rms_norm_mm_silu_mul"])
def test_opcheck(op):
    x, delta, weight, w = make_operands(3, 40, 50, dtype=torch.bfloat16, seed=0)
    torch.library.opcheck(getattr(torch.ops.rt, op).default, (x, delta, weight, w, EPS))


def test_triton_kernels_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


@pytest.mark.parametrize(("num_rows", "silu_mul"), [(1, False), (8, True), (41, False)])
def test_smollm2_prologue_compiles_for_hopper(num_rows, silu_mul):
    """SmolLM2's qkv and gate/up tilings with the prologue compile for sm_90."""
    from specrun.runtime.kernels import mm_silu_mul_triton, skinny_mm_triton

    depth = 576
    if silu_mul:
        kernel = mm_silu_mul_triton._mm_silu_mul_kernel
        config = mm_silu_mul_triton.mm_silu_mul_config(num_rows, 1536, depth)
    else:
        kernel = skinny_mm_triton._skinny_mm_kernel
        config = skinny_mm_triton.skinny_mm_config(num_rows, 960, depth)
    scalars = ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om",
               "stride_dm")  # fmt: skip
    pointers = ("x_ptr", "w_ptr", "out_ptr", "d_ptr", "nw_ptr", "h_ptr")
    signature = dict.fromkeys(pointers, "*bf16")
    signature.update(dict.fromkeys(scalars, "i32"), eps="fp32")
    block_m = skinny_mm_triton.dot_rows(num_rows) if config.use_dot else 1
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      EVEN_K=depth % config.block_k == 0, NORM=True,
                      NORM_BLOCK_K=min(1024, 16384 // block_m))  # fmt: skip
    ptx = compile_for_hopper(kernel, signature, constexprs, num_warps=config.num_warps,
                             num_stages=config.num_stages)  # fmt: skip
    assert ("mma" in ptx) == config.use_dot
    assert "rsqrt" in ptx


class _HopperTarget:
    """Triton's active driver as far as compiling to TTIR needs one: an sm_90 target."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("with_norm", [False, True])
def test_kernels_write_only_their_outputs(silu_mul, with_norm):
    """torch's analysis of what a triton_op's kernel writes (compiled graphs copy every input
    it cannot rule out) sees the product and, with the prologue, h: never x, delta or the
    weights, and nothing of an unused prologue's placeholders."""
    triton = pytest.importorskip("triton")
    from unittest import mock

    from torch._higher_order_ops import triton_kernel_wrap

    if not hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        pytest.skip("this torch names its kernel-access analysis otherwise")
    from specrun.runtime.kernels import mm_silu_mul_triton, skinny_mm_triton

    x, delta, weight, w = make_operands(8, 960, 576, dtype=torch.bfloat16, seed=0)
    h = torch.empty_like(x)
    norm = skinny_mm_triton.NormPrologue(delta, weight, EPS, h) if with_norm else None
    config = skinny_mm_triton.skinny_mm_config(8, 960, 576)
    block_m = skinny_mm_triton.dot_rows(8)
    kernel = (
        mm_silu_mul_triton._mm_silu_mul_kernel if silu_mul else skinny_mm_triton._skinny_mm_kernel
    )
    kwargs = dict(x_ptr=x, w_ptr=w, out_ptr=torch.empty(8, 960, dtype=x.dtype), M=8, N=960, K=576,
                  stride_xm=576, stride_xk=1, stride_wn=576, stride_wk=1, stride_om=960,
                  **skinny_mm_triton.norm_prologue_args(x, norm, block_m=block_m),
                  BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  EVEN_K=True)  # fmt: skip
    with mock.patch.object(triton.runtime.driver, "_active", _HopperTarget()):
        accessed = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
    written = {dep.name for dep in accessed.read_writes.writes}
    assert written == ({"out_ptr", "h_ptr"} if with_norm else {"out_ptr"})


INTERPRET_CASES = (
    # (rows, N, depth, silu_mul, norm_block_k): one row (elementwise products), a masked K
    # step, tensor-core tiles of 16 and 64 rows, the rows' squares read in several steps.
    (1, 37, 40, False, None),
    (1, 60, 1100, True, None),
    (3, 50, 64, False, 16),
    (8, 130, 100, True, None),
    (41, 70, 576, False, 128),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the kernels with the prologue on the CPU
    against the unfused ops of the same tiling on the reference's normed rows."""
    from specrun.runtime.kernels import skinny_mm_triton
    from specrun.runtime.kernels.mm_silu_mul_triton import launch_mm_silu_mul

    failures = 0
    default_tile = skinny_mm_triton._NORM_TILE
    for i, (num_rows, n, depth, silu_mul, norm_block_k) in enumerate(INTERPRET_CASES):
        x, delta, weight, w = make_operands(num_rows, 2 * n, depth, dtype=torch.float16, seed=i)
        skinny_mm_triton._NORM_TILE = default_tile
        if norm_block_k is not None:
            skinny_mm_triton._NORM_TILE = norm_block_k * skinny_mm_triton.dot_rows(num_rows)
        h = torch.empty_like(x)
        norm = skinny_mm_triton.NormPrologue(delta=delta, weight=weight, eps=EPS, h=h)
        launch = launch_mm_silu_mul if silu_mul else skinny_mm_triton.launch_skinny_mm
        got = launch(x, w, norm=norm)
        h_want, normed = add_rms_norm_ref(x, delta, weight, EPS)
        want = launch(normed, w)
        ok = torch.equal(h, h_want)
        ok = ok and torch.allclose(got.float(), want.float(), rtol=2e-3, atol=2e-3)
        ref = (add_rms_norm_mm_silu_mul_ref if silu_mul else add_rms_norm_mm_ref)(
            x, delta, weight, w, EPS
        )[0]
        ok = ok and torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
        failures += not ok
        print(f"case {i}: {num_rows} rows, N {n}, depth {depth} {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


# GPU tier ---------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param(1, 960, 576, id="smollm2-step-qkv"),
    pytest.param(8, 1536, 576, id="smollm2-draft-level"),
    pytest.param(41, 960, 576, id="smollm2-verification-qkv"),
    pytest.param(5, 333, 100, id="odd"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize(("num_rows", "n", "depth"), GPU_CASES)
def test_gpu_kernels_match_the_unfused_ops(num_rows, n, depth, silu_mul):
    x, delta, weight, w = make_operands(num_rows, 2 * n, depth, dtype=torch.bfloat16,
                                        seed=depth, device="cuda")  # fmt: skip
    op = add_rms_norm_mm_silu_mul if silu_mul else add_rms_norm_mm
    ref = add_rms_norm_mm_silu_mul_ref if silu_mul else add_rms_norm_mm_ref
    out, h = op(x, delta, weight, w, EPS)
    out_want, h_want = ref(x, delta, weight, w, EPS)
    assert torch.equal(h, h_want)
    # The same roundings; the norm's and the product's float32 sums in another order.
    torch.testing.assert_close(out, out_want, rtol=2e-2, atol=2e-2)


if __name__ == "__main__":
    sys.exit(_interpret_main())
