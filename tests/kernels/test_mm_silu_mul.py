"""rt::mm_silu_mul against SiLU(gate) * up of rt::skinny_mm's product.

CPU tier: the op on hypothesis-drawn shapes, its argument checks, opcheck, and the Triton
kernel under TRITON_INTERPRET=1 (in a subprocess; float16, which the interpreter multiplies
exactly, unlike bfloat16) and compiled for sm_90. GPU tier (`-m gpu`): the kernel at
SmolLM2's and Llama-3.1-8B's MLP shapes and odd ones.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import assert_script_passes_under_interpreter, compile_for_hopper

from specrun.runtime.kernels.mm_silu_mul import mm_silu_mul, mm_silu_mul_ref
from specrun.runtime.kernels.skinny_mm import MAX_ROWS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_operands(num_rows, intermediate, depth, *, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, depth, generator=gen)
    w = torch.randn(2 * intermediate, depth, generator=gen) * depth**-0.5
    return x.to(dtype).to(device), w.to(dtype).to(device)


def unfused(logits: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a stored [M, 2I] product, as the unfused graph computes it."""
    gate, up = logits.chunk(2, dim=-1)
    return F.silu(gate.float()).to(logits.dtype) * up


@settings(max_examples=30, deadline=None)
@given(
    num_rows=st.integers(1, MAX_ROWS),
    intermediate=st.integers(1, 200),
    depth=st.integers(1, 96),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_op_is_silu_gate_times_up(num_rows, intermediate, depth, dtype, seed):
    x, w = make_operands(num_rows, intermediate, depth, dtype=dtype, seed=seed)
    out = mm_silu_mul(x, w)
    assert out.shape == (num_rows, intermediate) and out.dtype == dtype
    want = unfused((x.float() @ w.float().T).to(dtype))
    assert torch.equal(out, want)


def test_an_odd_number_of_rows_is_refused():
    x, w = make_operands(2, 4, 8, dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="2I"):
        mm_silu_mul(x, w[:7])


def test_mismatched_operands_are_refused():
    x, w = make_operands(2, 4, 8, dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="rt::mm_silu_mul: x"):
        mm_silu_mul(x[:, :7], w)


def test_opcheck():
    x, w = make_operands(3, 20, 50, dtype=torch.bfloat16, seed=0)
    torch.library.opcheck(torch.ops.rt.mm_silu_mul.default, (x, w))


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


@pytest.mark.parametrize(("num_rows", "intermediate", "depth"), [(1, 1536, 576), (8, 1536, 576),
                                                                 (41, 1536, 576)])  # fmt: skip
def test_smollm2_tilings_compile_for_hopper(num_rows, intermediate, depth):
    """The tilings of SmolLM2's MLP (a step, a draft level, a verification) compile for
    sm_90 with their warps and stages."""
    from specrun.runtime.kernels import mm_silu_mul_triton as kernel
    from specrun.runtime.kernels.skinny_mm_triton import dot_rows

    config = kernel.mm_silu_mul_config(num_rows, intermediate, depth)
    scalars = ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om")
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    signature.update(dict.fromkeys(scalars, "i32"))
    block_m = dot_rows(num_rows) if config.use_dot else 1
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      EVEN_K=depth % config.block_k == 0)  # fmt: skip
    ptx = compile_for_hopper(
        kernel._mm_silu_mul_kernel,
        signature,
        constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    assert ("mma" in ptx) == config.use_dot


INTERPRET_CASES = (
    # (rows, I, depth): one row (elementwise products), a partial block, several blocks with
    # a masked K step, tensor-core tiles of 16 and 64 rows.
    (1, 37, 40),
    (1, 300, 1100),
    (3, 50, 64),
    (8, 130, 100),
    (41, 70, 576),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the kernel on the CPU against SiLU(gate) *
    up of the same tiling's rt::skinny_mm product (the same sums)."""
    from specrun.runtime.kernels.mm_silu_mul_triton import launch_mm_silu_mul, mm_silu_mul_config
    from specrun.runtime.kernels.skinny_mm_triton import launch_skinny_mm

    failures = 0
    for i, (num_rows, intermediate, depth) in enumerate(INTERPRET_CASES):
        x, w = make_operands(num_rows, intermediate, depth, dtype=torch.float16, seed=i)
        config = mm_silu_mul_config(num_rows, intermediate, depth)
        got = launch_mm_silu_mul(x, w, config=config)
        # The unfused product with the same K steps (rows per program do not change a sum).
        product = launch_skinny_mm(x, w, config=config)
        want = unfused(product)
        ok = torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-3)
        ok = ok and torch.allclose(got.float(), mm_silu_mul_ref(x, w).float(), rtol=2e-2, atol=2e-2)
        failures += not ok
        print(
            f"case {i}: {num_rows} rows, I {intermediate}, depth {depth} {'ok' if ok else 'FAIL'}"
        )
    return 1 if failures else 0


# GPU tier ---------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param(1, 1536, 576, id="smollm2-step"),
    pytest.param(8, 1536, 576, id="smollm2-draft-level"),
    pytest.param(41, 1536, 576, id="smollm2-verification"),
    pytest.param(1, 14336, 4096, id="8b-step"),
    pytest.param(40, 14336, 4096, id="8b-verification"),
    pytest.param(5, 333, 100, id="odd"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("num_rows", "intermediate", "depth"), GPU_CASES)
def test_gpu_kernel_matches_the_unfused_ops(num_rows, intermediate, depth):
    from specrun.runtime.kernels.skinny_mm import skinny_mm

    x, w = make_operands(num_rows, intermediate, depth, dtype=torch.bfloat16, seed=depth,
                         device="cuda")  # fmt: skip
    got = mm_silu_mul(x, w)
    # Same sums up to float32 order, then the same roundings: a bf16 step apart at most.
    torch.testing.assert_close(got, unfused(skinny_mm(x, w)), rtol=1e-2, atol=1e-2)


if __name__ == "__main__":
    sys.exit(_interpret_main())
