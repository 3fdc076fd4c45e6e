"""rt::tree_attention vs the reference tree attention in models/attention.py.

CPU tier: the op's CPU implementation on hypothesis-drawn shapes, opcheck, torch.compile, and the
Triton kernels under TRITON_INTERPRET=1 (in a subprocess, so the variable never reaches the
triton imported here) and compiled for sm_90. GPU tier (`-m gpu`): the Triton kernels on odd
shapes, under torch.compile, and replayed from a CUDA graph with changed cache lengths.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from triton_interpreter import assert_script_passes_under_interpreter, compile_for_hopper

from specrun.models.attention import host_attention_mask, pack_ancestor_mask
from specrun.models.attention import tree_attention as model_tree_attention
from specrun.runtime.kernels.tree_attention import (
    tree_attention,
    tree_attention_ref,
)
from specrun.runtime.kernels.tree_attention_config import (
    LaunchConfig,
    check_inputs,
    launch_config,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Case:
    """One tree-attention problem: B slots, Hq/Hkv heads, M queries over S cache + N tree keys."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    num_queries: int
    num_tree: int
    cache_size: int
    head_dim: int


def make_inputs(
    case: Case,
    *,
    dtype: torch.dtype,
    device: str = "cpu",
    cache_len: list[int] | None = None,
    generator: torch.Generator | None = None,
    layer_buffer: bool = False,
) -> dict:
    """Random inputs for `case` as keyword arguments of tree_attention (scale included).

    Each query sees at least one tree key, so no output row is fully masked. With
    `layer_buffer`, the cache is layer 1 of a [3, B, Hkv, S + 7, D] buffer cut to S positions
    (non-contiguous: batch and head strides of the larger buffer).
    """
    c = case
    gen = generator or torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    cache_shape = (c.batch, c.num_kv_heads, c.cache_size, c.head_dim)
    if layer_buffer:
        buffer_shape = (3, c.batch, c.num_kv_heads, c.cache_size + 7, c.head_dim)
        k_cache = randn(*buffer_shape)[1, :, :, : c.cache_size]
        v_cache = randn(*buffer_shape)[1, :, :, : c.cache_size]
    else:
        k_cache, v_cache = randn(*cache_shape), randn(*cache_shape)
    if cache_len is None:
        cache_len = torch.randint(0, c.cache_size + 1, (c.batch,), generator=gen).tolist()
    mask = torch.rand(c.batch, c.num_queries, c.num_tree, generator=gen) < 0.5
    forced = torch.randint(0, c.num_tree, (c.batch, c.num_queries, 1), generator=gen)
    mask.scatter_(-1, forced, True)
    return {
        "q": randn(c.batch, c.num_q_heads, c.num_queries, c.head_dim),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cache_len": torch.tensor(cache_len, dtype=torch.int64, device=device),
        "k_tree": randn(c.batch, c.num_kv_heads, c.num_tree, c.head_dim),
        "v_tree": randn(c.batch, c.num_kv_heads, c.num_tree, c.head_dim),
        "anc": pack_ancestor_mask(mask).to(device),
        "scale": c.head_dim**-0.5,
    }


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out has NaNs)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _model_ref(inputs: dict) -> torch.Tensor:
    """models/attention.py's SDPA formulation in float64 on the CPU."""
    args = {k: v.cpu() for k, v in inputs.items() if k != "scale"}
    args = {k: v.double() if v.is_floating_point() else v for k, v in args.items()}
    return model_tree_attention(**args, scale=inputs["scale"])


@st.composite
def cases(draw) -> tuple[Case, list[int]]:
    num_kv_heads = draw(st.integers(1, 3))
    case = Case(
        batch=draw(st.integers(1, 3)),
        num_q_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])),
        num_kv_heads=num_kv_heads,
        num_queries=draw(st.integers(1, 9)),
        num_tree=draw(st.integers(1, 70)),
        cache_size=draw(st.integers(0, 45)),
        head_dim=draw(st.sampled_from([4, 8, 16])),
    )
    lens = draw(st.lists(st.integers(0, case.cache_size), min_size=case.batch, max_size=case.batch))
    return case, lens


@settings(max_examples=60, deadline=None)
@given(
    drawn=cases(), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 99)
)
def test_cpu_op_matches_model_reference(drawn, dtype, seed):
    case, lens = drawn
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(case, dtype=dtype, cache_len=lens, generator=gen)
    out = tree_attention(**inputs)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert relative_error(out, _model_ref(inputs)) < tol


def test_host_mask_reads_only_the_longest_slots_cache():
    """Eager on the CPU, a forward's shared mask (`host_attention_mask`) covers [0, max
    cache_len) only: the result is the full mask's up to float64 rounding, and a cache tail of
    NaN (never read)
    leaves it as it is."""
    case = Case(2, 4, 2, 3, 3, 16, 8)
    inputs = make_inputs(case, dtype=torch.float32, cache_len=[5, 9])
    want = _model_ref(inputs)
    for name in ("k_cache", "v_cache"):
        inputs[name][:, :, 9:] = float("nan")
    scale = inputs.pop("scale")
    args = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    mask = host_attention_mask(args["cache_len"], args["anc"], num_tree_keys=case.num_tree)
    assert mask.shape == (2, 1, 3, 9 + case.num_tree)
    got = model_tree_attention(**args, scale=scale, mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(drawn=cases(), seed=st.integers(0, 99))
def test_host_attention_with_stacked_query_heads_matches_the_full_mask(drawn, seed):
    """The eager CPU forward's attention (the shared mask, each key/value head's query heads
    stacked as its queries) equals the traced formulation (full mask, SDPA's enable_gqa) on
    any grouping, query count and cache lengths, in float64."""
    case, lens = drawn
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(case, dtype=torch.float64, cache_len=lens, generator=gen)
    scale = inputs.pop("scale")
    mask = host_attention_mask(inputs["cache_len"], inputs["anc"], num_tree_keys=case.num_tree)
    got = model_tree_attention(**inputs, scale=scale, mask=mask)
    torch.testing.assert_close(got, model_tree_attention(**inputs, scale=scale))


def test_ref_fully_masked_row_is_zero():
    inputs = make_inputs(Case(1, 2, 1, 2, 3, 8, 8), dtype=torch.float64, cache_len=[0])
    inputs["anc"][0, 1] = 0
    out = tree_attention_ref(**inputs)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.isfinite(out).all()


def test_check_inputs_names_the_problem():
    inputs = make_inputs(Case(2, 4, 2, 3, 70, 11, 16), dtype=torch.bfloat16, cache_len=[5, 0])
    check_inputs(**inputs)
    bad = {
        "heads": {"q": inputs["q"][:, :3]},
        "cache": {"v_cache": inputs["v_cache"][..., :8]},
        "anc": {"anc": inputs["anc"][..., :1]},
        "int64": {"cache_len": inputs["cache_len"].int()},
        "scale": {"scale": -1.0},
        "fp16/bf16/fp32": {"q": inputs["q"].double()},
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            check_inputs(**(inputs | change))


def test_symbolic_shapes_get_one_config_without_guards():
    # A dynamic prefill traces the op with a symbolic batch and length; a branch on them would
    # add a guard, and a precompiled prefill would then serve only the warm-up's lengths.
    shape_env = ShapeEnv()

    def symbolic(hint: int, name: str) -> torch.SymInt:
        symbol = shape_env.create_symbol(hint, ConstantSource(name), DimDynamic.DYNAMIC)
        return shape_env.create_symintnode(symbol, hint=hint)

    batch, length = symbolic(3, "batch"), symbolic(5, "length")
    config = launch_config(
        batch=batch, num_kv_heads=8, num_rows=4 * length, cache_size=1, head_dim=128, num_sms=132
    )
    assert not shape_env.guards
    assert config.num_splits == 1
    concrete = launch_config(
        batch=3, num_kv_heads=8, num_rows=4 * 5, cache_size=1, head_dim=128, num_sms=132
    )
    assert concrete != config  # the static table still sees few rows
    fixed = launch_config(
        batch=3, num_kv_heads=8, num_rows=4 * 5, cache_size=1, head_dim=128, num_sms=132,
        fixed=True,
    )  # fmt: skip
    assert fixed == config  # what the op runs with when the pass fused it in a dynamic graph


@pytest.mark.parametrize(
    ("batch", "num_kv_heads", "num_rows", "head_dim", "cache_size", "expected"),
    [
        # (block_r, block_n, num_splits) measured fastest on an H200 at 128-3000 keys of a
        # 4512-position cache.
        pytest.param(1, 3, 3 * 40, 64, 4512, (16, 64, 6), id="smollm2-verify-b1"),
        pytest.param(1, 3, 3, 64, 4512, (16, 32, 35), id="smollm2-step-b1"),
        pytest.param(16, 3, 3 * 16, 64, 4512, (64, 32, 1), id="smollm2-verify-b16"),
        pytest.param(1, 8, 4 * 60, 128, 4512, (16, 64, 1), id="8b-verify-b1"),
        pytest.param(32, 8, 4 * 8, 128, 4512, (32, 32, 1), id="8b-verify-b32"),
        # Long caches keep the long-context table (64-row tiles, about 2 programs per SM).
        pytest.param(1, 8, 4 * 60, 128, 32768, (64, 32, 9), id="8b-verify-b1-32k"),
        pytest.param(8, 8, 4 * 8, 128, 8192, (32, 64, 5), id="8b-n8-b8-8k"),
    ],
)
def test_launch_config_for_round_shapes(
    batch, num_kv_heads, num_rows, head_dim, cache_size, expected
):
    # Small batches over short caches take 16-row tiles (more, shorter programs); the prefix
    # is split only while the partials stay few (many output rows: no split, no partials).
    config = launch_config(
        batch=batch, num_kv_heads=num_kv_heads, num_rows=num_rows, cache_size=cache_size,
        head_dim=head_dim, num_sms=132,
    )  # fmt: skip
    assert (config.block_r, config.block_n, config.num_splits) == expected


def test_opcheck():
    inputs = make_inputs(Case(2, 4, 2, 3, 4, 11, 8), dtype=torch.float32, cache_len=[5, 0])
    scale = inputs.pop("scale")
    torch.library.opcheck(
        torch.ops.rt.tree_attention.default, tuple(inputs.values()), {"scale": scale}
    )


def test_compile_fullgraph_cpu():
    inputs = make_inputs(Case(2, 4, 2, 3, 6, 13, 8), dtype=torch.float32, cache_len=[13, 4])

    def attend(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, *, scale):
        return tree_attention(q * 2, k_cache, v_cache, cache_len, k_tree, v_tree, anc,
                              scale=scale) + 1  # fmt: skip

    compiled = torch.compile(attend, fullgraph=True, backend="inductor")
    expected = attend(**inputs)
    torch.testing.assert_close(compiled(**inputs), expected, rtol=1e-5, atol=1e-5)


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


@pytest.mark.parametrize("write_partials", [False, True])
@pytest.mark.parametrize("peel_tail", [False, True])
def test_triton_kernel_compiles_for_hopper(write_partials, peel_tail):
    """Every variant the launcher picks compiles for sm_90 (the interpreter runs only the
    branches taken, so it misses a name or type error in another)."""
    from specrun.runtime.kernels.tree_attention_triton import _tree_attention_kernel

    pointers = {
        "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "cache_len_ptr": "*i64",
        "kt_ptr": "*bf16", "vt_ptr": "*bf16", "anc_ptr": "*i64", "out_ptr": "*bf16",
        "part_out_ptr": "*fp32" if write_partials else "*bf16",
        "part_lse_ptr": "*fp32" if write_partials else "*bf16", "arrivals_ptr": "*i32",
    }  # fmt: skip
    names = inspect.signature(_tree_attention_kernel.fn).parameters
    signature = {name: "i32" for name in names if name.islower() and name not in pointers}
    signature.update(pointers, qk_scale="fp32")
    ptx = compile_for_hopper(
        _tree_attention_kernel,
        signature,
        dict(GROUP=4, HEAD_DIM=64, BLOCK_R=16, BLOCK_N=32, WRITE_PARTIALS=write_partials,
             PEEL_TAIL=peel_tail, DOT_PRECISION="tf32", MERGE_SPLITS=8),
    )  # fmt: skip
    # Only a launch that writes partials counts its arrivals.
    assert ("atom.global" in ptx) == write_partials


INTERPRET_CASES = (
    # (case, cache_len, block_r, block_n, num_prefix_splits[, min_split_len])
    (Case(2, 4, 2, 3, 5, 37, 16), [37, 0], 16, 16, 1),
    (Case(2, 4, 1, 5, 70, 50, 32), [13, 50], 32, 16, 3),
    (Case(1, 2, 2, 1, 1, 20, 16), [20], 16, 16, 2),
    (Case(1, 8, 2, 9, 9, 40, 16), [33], 16, 16, 2),
    (Case(2, 8, 1, 9, 9, 70, 16), [70, 37], 64, 16, 3),  # 64-row blocks: peeled tail
    (Case(2, 4, 2, 33, 33, 70, 16), [70, 5], 64, 32, 1),  # the dynamic-shape config
    # More splits than a short prefix has blocks: the trailing ones read nothing.
    (Case(3, 4, 2, 3, 7, 90, 16), [90, 17, 1], 16, 16, 7),
    # A share of at least 48 keys: 90 keys on two splits, 17 and 1 on one, the rest unread.
    (Case(3, 4, 2, 3, 7, 90, 16), [90, 17, 1], 16, 16, 7, 48),
    (Case(2, 8, 2, 5, 5, 200, 16), [0, 200], 16, 32, 4, 64),
    # Eleven partials, merged eight at a time (head dim 64), and a slot with two.
    (Case(2, 2, 1, 1, 1, 600, 64), [600, 90], 16, 16, 10),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the Triton kernels on the CPU vs the reference;
    the splits' arrival counters (one buffer for every launch) zeroed again after each."""
    from specrun.runtime.kernels.arrivals import arrival_counters
    from specrun.runtime.kernels.tree_attention_triton import launch_tree_attention

    failures = 0
    for i, (case, lens, block_r, block_n, num_splits, *min_split_len) in enumerate(INTERPRET_CASES):
        gen = torch.Generator().manual_seed(i)
        inputs = make_inputs(case, dtype=torch.float32, cache_len=lens, generator=gen)
        config = LaunchConfig(block_r, block_n, num_splits, 4, 1, *min_split_len)
        out = launch_tree_attention(**inputs, config=config)
        err = relative_error(out, _model_ref(inputs))
        zeroed = not arrival_counters(out, 1).any()
        ok = err < 1e-5 and zeroed
        failures += not ok
        print(f"case {i}: {case} splits={num_splits} rel_err={err:.2e} counters zeroed={zeroed}"
              f" {'ok' if ok else 'FAIL'}")  # fmt: skip
    return 1 if failures else 0


# GPU tier ---------------------------------------------------------------------------------------

GPU_CASES = [
    # batch, Hq, Hkv, M, N, S, D
    pytest.param(Case(3, 8, 8, 5, 5, 1000, 64), id="mha-d64"),
    pytest.param(Case(2, 32, 8, 7, 7, 2049, 128), id="gqa4-d128"),
    pytest.param(Case(2, 32, 4, 3, 13, 777, 128), id="gqa8-rect"),
    pytest.param(Case(1, 32, 8, 64, 64, 5000, 128), id="gqa4-m64"),
    pytest.param(Case(2, 16, 2, 40, 100, 300, 64), id="gqa8-n100-w2"),
    pytest.param(Case(4, 32, 8, 1, 1, 4097, 128), id="decode"),
    pytest.param(Case(1, 16, 4, 128, 128, 900, 128), id="m128"),
    pytest.param(Case(2, 8, 2, 9, 17, 333, 256), id="d256"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fixed_config", [False, True], ids=["tuned", "fixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_matches_reference(case, dtype, fixed_config):
    gen = torch.Generator().manual_seed(case.cache_size)
    lens = [case.cache_size, 0, case.cache_size // 3, 1][: case.batch]
    inputs = make_inputs(case, dtype=dtype, device="cuda", cache_len=lens, generator=gen)
    out = tree_attention(**inputs, fixed_config=fixed_config)
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert out.transpose(1, 2).is_contiguous()  # what the output projection reads
    assert relative_error(out, _model_ref(inputs)) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("num_splits", "min_split_len"),
    # 512 keys a share: 1500 on 3 of 7 splits, 701 on 2; 2048: every prefix in the tree split.
    [(1, 0), (3, 0), (7, 0), (7, 512), (3, 2048)],
)
def test_gpu_layer_buffer_slice_and_forced_splits(num_splits, min_split_len):
    from specrun.runtime.kernels.tree_attention_triton import launch_tree_attention

    case = Case(3, 32, 8, 6, 11, 1500, 128)
    inputs = make_inputs(case, dtype=torch.bfloat16, device="cuda", cache_len=[1500, 0, 701],
                         layer_buffer=True)  # fmt: skip
    assert not inputs["k_cache"].is_contiguous()
    config = LaunchConfig(16, 64, num_splits, 4, 3, min_split_len)
    out = launch_tree_attention(**inputs, config=config)
    assert relative_error(out, _model_ref(inputs)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_and_empty_cache():
    inputs = make_inputs(Case(2, 8, 2, 4, 6, 0, 64), dtype=torch.float32, device="cuda",
                         cache_len=[0, 0])  # fmt: skip
    assert relative_error(tree_attention(**inputs), _model_ref(inputs)) < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_gpu_compile_fullgraph():
    inputs = make_inputs(Case(2, 32, 8, 8, 8, 1000, 128), dtype=torch.bfloat16, device="cuda",
                         cache_len=[999, 17])  # fmt: skip

    def attend(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, *, scale):
        return tree_attention(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, scale=scale)

    out = torch.compile(attend, fullgraph=True)(**inputs)
    assert relative_error(out, _model_ref(inputs)) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay_with_new_lengths():
    case = Case(4, 32, 8, 8, 8, 3000, 128)
    inputs = make_inputs(case, dtype=torch.bfloat16, device="cuda", cache_len=[3000] * 4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tree_attention(**inputs)  # warm-up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(**inputs)
    for lens in ([3000, 0, 1, 2999], [64, 1500, 3000, 129], [0, 0, 0, 0]):
        inputs["cache_len"].copy_(torch.tensor(lens))
        inputs["q"].normal_()
        graph.replay()
        assert relative_error(out, _model_ref(inputs)) < 1e-2, lens


if __name__ == "__main__":
    sys.exit(_interpret_main())
