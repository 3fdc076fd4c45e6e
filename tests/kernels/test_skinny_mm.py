"""rt::skinny_mm against its reference (x @ w.T in float32, rounded once).

CPU tier: the op on hypothesis-drawn shapes and strides, its argument checks, opcheck, and the
Triton kernel under TRITON_INTERPRET=1 (in a subprocess; float16, which the interpreter
multiplies exactly, unlike bfloat16) with both of its paths and ragged edges, and compiled
for sm_90. GPU tier
(`-m gpu`): every tiling the op picks, on odd shapes and Llama-3.1-8B's, under torch.compile
and in a CUDA graph.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import assert_script_passes_under_interpreter, compile_for_hopper

from specrun.runtime.kernels.skinny_mm import MAX_ROWS, skinny_mm, skinny_mm_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_operands(num_rows, n, k, *, dtype, seed, device="cpu", transposed_x=False):
    """x [num_rows, k] and w [n, k] with outputs of order 1; x column-major if asked."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(k, num_rows, generator=gen).T if transposed_x else torch.randn(num_rows, k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return x.to(dtype).to(device), w.to(dtype).to(device)


def assert_close_to_reference(out, x, w):
    want = skinny_mm_ref(x, w)
    assert out.shape == want.shape and out.dtype == x.dtype and out.is_contiguous()
    # Float32 sums in another order: at most a unit in the output's last place apart.
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@settings(max_examples=30, deadline=None)
@given(
    num_rows=st.integers(1, MAX_ROWS),
    n=st.integers(1, 70),
    k=st.integers(1, 300),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    transposed_x=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_op_is_the_product_rounded_once(num_rows, n, k, dtype, transposed_x, seed):
    x, w = make_operands(num_rows, n, k, dtype=dtype, seed=seed, transposed_x=transposed_x)
    out = skinny_mm(x, w)
    assert out.shape == (num_rows, n) and out.dtype == dtype and out.is_contiguous()
    exact = torch.nn.functional.linear(x.double(), w.double())
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize(
    ("x", "w", "message"),
    [
        (torch.zeros(2, 8, dtype=torch.float32), torch.zeros(4, 8), "float32"),
        (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.float16), "one"),
        (torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16), torch.zeros(4, 8).bfloat16(), "rows"),
        (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16), "K"),
        (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), r"\[M"),
        (torch.zeros(0, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), "rows"),
    ],
)
def test_bad_arguments_are_refused(x, w, message):
    with pytest.raises(ValueError, match=message):
        skinny_mm(x, w)


def test_operands_past_32_bit_offsets_are_refused():
    x = torch.zeros(1, 4, dtype=torch.bfloat16, device="meta")
    w = torch.zeros(2**29 + 1, 4, dtype=torch.bfloat16, device="meta")
    skinny_mm(x, w[: 2**29])  # the last element at offset 2**31 - 1: taken
    with pytest.raises(ValueError, match="2\\*\\*31"):
        skinny_mm(x, w)


def test_opcheck():
    x, w = make_operands(3, 20, 50, dtype=torch.bfloat16, seed=0)
    torch.library.opcheck(torch.ops.rt.skinny_mm.default, (x, w))


@pytest.mark.parametrize("even_k", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
def test_triton_kernel_compiles_for_hopper(block_m, even_k):
    """Both K-loop variants compile for sm_90 at the smallest and largest row tiles."""
    from specrun.runtime.kernels.skinny_mm_triton import _skinny_mm_kernel

    scalars = ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om")
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    signature.update(dict.fromkeys(scalars, "i32"))
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, EVEN_K=even_k)
    assert "mma" in compile_for_hopper(_skinny_mm_kernel, signature, constexprs)


def test_short_rows_fitted_tilings_compile_for_hopper():
    """Every tiling the table picks for SmolLM2's products (576- and 1536-column rows: one-step
    rows, 4-row programs, 2 warps, 64-column steps) compiles for sm_90 with its warps and
    stages."""
    from specrun.runtime.kernels import skinny_mm_triton as kernel

    scalars = ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om")
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    signature.update(dict.fromkeys(scalars, "i32"))
    shapes = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
    launches = set()
    for num_rows, (n, k) in itertools.product([1, 8, 41], shapes):
        config = kernel.skinny_mm_config(num_rows, n, k)
        block_m = kernel.dot_rows(num_rows) if config.use_dot else 1
        even_k = k % config.block_k == 0
        launches.add((block_m, config.block_n, config.block_k, even_k, config.num_warps,
                      config.num_stages))  # fmt: skip
    for block_m, block_n, block_k, even_k, num_warps, num_stages in sorted(launches):
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=even_k)
        ptx = compile_for_hopper(
            kernel._skinny_mm_kernel,
            signature,
            constexprs,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        assert ("mma" in ptx) == (block_m > 1)


@pytest.mark.parametrize("num_rows", [1, 2, 16, 17, 33, MAX_ROWS])
@pytest.mark.parametrize(
    ("n", "k"), [(576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 14336)]
)
def test_every_fitted_tiling_pipelines_within_shared_memory(num_rows, n, k):
    pytest.importorskip("triton")
    from specrun.runtime.kernels import skinny_mm_triton as kernel

    config = kernel.skinny_mm_config(num_rows, n, k)
    rows = kernel.dot_rows(num_rows) if config.use_dot else 1
    stage_bytes = (rows + config.block_n) * config.block_k * 2
    one_step = config.block_k >= k
    assert config.use_dot == (num_rows > 1)
    assert config.num_stages * stage_bytes <= 227 * 1024
    assert one_step or config.num_stages >= 2  # a loop of several steps pipelines its loads
    assert config.block_k < 2 * k and rows >= num_rows


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


INTERPRET_CASES = (
    # (rows, n, k, block_n, block_k, use_dot): whole blocks, ragged n and k, strided x
    (1, 32, 128, 8, 64, False),
    (1, 37, 100, 8, 32, False),
    (1, 22, 100, 4, 128, False),  # one step wider than k: 4-row programs, one masked load
    (3, 40, 70, 16, 32, True),
    (16, 33, 128, 16, 32, True),
    (5, 64, 96, 32, 32, True),
    (17, 48, 64, 16, 32, True),
    (40, 24, 96, 16, 32, True),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the Triton kernel on the CPU vs the reference."""
    from specrun.runtime.kernels.skinny_mm_triton import SkinnyMMConfig, launch_skinny_mm

    failures = 0
    for i, (num_rows, n, k, block_n, block_k, use_dot) in enumerate(INTERPRET_CASES):
        config = SkinnyMMConfig(block_n, block_k, num_warps=4, num_stages=1, use_dot=use_dot)
        x, w = make_operands(num_rows, n, k, dtype=torch.float16, seed=i, transposed_x=i == 4)
        out = launch_skinny_mm(x, w, config=config)
        want = skinny_mm_ref(x, w)
        ok = out.shape == want.shape and torch.allclose(out, want, rtol=1e-2, atol=1e-2)
        failures += not ok
        print(f"case {i}: {num_rows}x{k} @ {n}x{k} {config} {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


# GPU tier ---------------------------------------------------------------------------------------

GPU_SHAPES = [
    pytest.param(6144, 4096, id="8b-qkv"),
    pytest.param(4096, 14336, id="8b-down"),
    pytest.param(960, 576, id="smollm2-qkv"),
    pytest.param(3072, 576, id="smollm2-gate-up"),
    pytest.param(6200, 600, id="vocabulary-like"),
    pytest.param(77, 300, id="ragged"),
    pytest.param(1, 64, id="one-column"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 16, 17, 40, MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
def test_gpu_kernel_matches_reference(n, k, num_rows, dtype):
    x, w = make_operands(num_rows, n, k, dtype=dtype, seed=n + k, device="cuda")
    assert_close_to_reference(skinny_mm(x, w), x, w)
    x, _ = make_operands(num_rows, n, k, dtype=dtype, seed=1, device="cuda", transposed_x=True)
    assert_close_to_reference(skinny_mm(x, w), x, w)


@pytest.mark.gpu
@needs_cuda
def test_gpu_under_compile_and_in_a_cuda_graph():
    x, w = make_operands(4, 300, 520, dtype=torch.bfloat16, seed=3, device="cuda")
    compiled = torch.compile(lambda x, w: skinny_mm(x * 2, w), fullgraph=True)
    assert_close_to_reference(compiled(x, w), x * 2, w)
    skinny_mm(x, w)  # compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_mm(x, w)
    x.copy_(make_operands(4, 300, 520, dtype=torch.bfloat16, seed=4, device="cuda")[0])
    graph.replay()
    assert_close_to_reference(out, x, w)


if __name__ == "__main__":
    sys.exit(_interpret_main())
