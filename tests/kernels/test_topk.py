"""rt::topk against its reference (a stable descending sort cut at k) and torch.topk;
rt::log_softmax_topk against log_softmax followed by that sort.

CPU tier: the ops on hypothesis-drawn shapes with ties and -inf, their argument checks,
opcheck, and the Triton kernels under TRITON_INTERPRET=1 (in a subprocess, so the variable never
reaches the triton imported here) and compiled for sm_90. GPU tier (`-m gpu`): the kernels on
odd shapes, under torch.compile and in a CUDA graph.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import assert_script_passes_under_interpreter, compile_for_hopper

from specrun.runtime.kernels.topk import (
    MAX_CHUNK,
    MAX_K,
    log_softmax_topk,
    log_softmax_topk_ref,
    topk,
    topk_ref,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_rows(
    shape: tuple[int, ...], *, dtype: torch.dtype, seed: int, ties: bool | str, device: str = "cpu"
) -> torch.Tensor:
    """Random rows; with `ties`, few distinct values (many equal entries) and some -inf; with
    "signed zeros", mostly 0.0 and -0.0 (equal values that differ in their sign bit)."""
    gen = torch.Generator().manual_seed(seed)
    if ties == "signed zeros":
        x = (
            torch.randint(-1, 2, shape, generator=gen)
            * torch.tensor([0.0, -0.0, 1.0]).repeat(shape[-1] // 3 + 1)[: shape[-1]]
        )
    elif ties:
        x = torch.randint(-3, 3, shape, generator=gen).to(torch.float32)
        x[torch.rand(shape, generator=gen) < 0.2] = float("-inf")
    else:
        x = torch.randn(shape, generator=gen)
    return x.to(dtype).to(device)


def assert_matches_reference(values: torch.Tensor, columns: torch.Tensor, x: torch.Tensor, k: int):
    want_values, want_columns = topk_ref(x.cpu(), k)
    assert values.dtype == x.dtype and columns.dtype == torch.int64
    assert torch.equal(values.cpu(), want_values)
    assert torch.equal(columns.cpu(), want_columns)


def assert_log_probs_match(values: torch.Tensor, columns: torch.Tensor, x: torch.Tensor, k: int):
    """The columns of topk_ref, valued as log_softmax in float32 (to its rounding)."""
    x = x.cpu()
    assert values.dtype == torch.float32 and columns.dtype == torch.int64
    assert torch.equal(columns.cpu(), topk_ref(x, k)[1])
    want = x.float().log_softmax(-1).gather(-1, columns.cpu())
    torch.testing.assert_close(values.cpu(), want, rtol=1e-5, atol=1e-5)


# Hypothesis strategies for a batch of rows and a k: shapes, ties and -inf, dtypes.
ROW_CASES = dict(
    leading=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    num_cols=st.integers(1, 300),
    k=st.integers(1, MAX_K),
    ties=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=40, deadline=None)
@given(**ROW_CASES)
def test_op_is_a_stable_descending_sort_cut_at_k(leading, num_cols, k, ties, dtype, seed):
    k = min(k, num_cols)
    x = make_rows((*leading, num_cols), dtype=dtype, seed=seed, ties=ties)
    values, columns = topk(x, k)
    assert values.shape == columns.shape == (*leading, k)
    want_values, _ = torch.topk(x, k)
    assert torch.equal(values, want_values)
    assert torch.equal(x.gather(-1, columns), values)
    # Equal values come in ascending column order.
    same_value = values[..., 1:] == values[..., :-1]
    assert bool((columns[..., 1:] > columns[..., :-1])[same_value].all())


@settings(max_examples=30, deadline=None)
@given(**ROW_CASES)
def test_log_softmax_topk_selects_as_topk_and_values_as_log_softmax(
    leading, num_cols, k, ties, dtype, seed
):
    k = min(k, num_cols)
    x = make_rows((*leading, num_cols), dtype=dtype, seed=seed, ties=ties)
    x[..., 0] = 0.0  # a finite entry per row
    values, columns = log_softmax_topk(x, k)
    assert values.shape == columns.shape == (*leading, k)
    assert_log_probs_match(values, columns, x, k)


@pytest.mark.parametrize("op", [topk, log_softmax_topk])
@pytest.mark.parametrize(
    ("x", "k", "message"),
    [
        (torch.zeros(3, 5), 6, "k=6"),
        (torch.zeros(3, 100), MAX_K + 1, f"k={MAX_K + 1}"),
        (torch.zeros(3, 5), 0, "k=0"),
        (torch.zeros(3, 5, dtype=torch.float64), 2, "float64"),
        (torch.zeros(3, 5, dtype=torch.int64), 2, "int64"),
        (torch.zeros(3, 0), 1, "at least one"),
    ],
)
def test_bad_arguments_are_refused(op, x, k, message):
    if op is log_softmax_topk and message == "float64":
        assert_log_probs_match(*op(x, k), x, k)  # float64 logits take the reference
        return
    with pytest.raises(ValueError, match=message):
        op(x, k)


@pytest.mark.parametrize("op", [torch.ops.rt.topk.default, torch.ops.rt.log_softmax_topk.default])
def test_opcheck(op):
    x = make_rows((3, 7, 50), dtype=torch.float32, seed=0, ties=False)
    torch.library.opcheck(op, (x, 5))


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


@pytest.mark.parametrize("num_rows", [1, 8, 9, 64])
@pytest.mark.parametrize("num_cols", [1, 328, 14336, 32000, 32769, 128256])
def test_launch_forms_stay_within_the_kernels_limits(num_rows, num_cols):
    """Every launch form: a power-of-2 chunk of at most MAX_CHUNK columns, 1-8 warps, and a
    merge of at most 8192 keys at k = MAX_K (one program holds them in registers)."""
    pytest.importorskip("triton")
    from specrun.runtime.kernels.topk_triton import topk_config

    config = topk_config(num_rows, num_cols)
    assert config.block & (config.block - 1) == 0 and config.block <= MAX_CHUNK
    assert config.num_warps in (1, 2, 4, 8)
    assert -(-num_cols // config.block) * MAX_K <= 8192


@pytest.mark.parametrize("by_sort", [False, True])
@pytest.mark.parametrize("two_stages", [False, True])
@pytest.mark.parametrize("log_softmax", [False, True])
def test_triton_kernel_compiles_for_hopper(two_stages, log_softmax, by_sort):
    """Both launch forms (one chunk a row; chunks merged by the last to finish) compile for
    sm_90, with and without the log-softmax (the interpreter skips the branches not taken),
    selecting by max-reductions or by a bitonic top-k."""
    from specrun.runtime.kernels.topk_triton import _topk_kernel

    signature = {
        "x_ptr": "*bf16", "keys_ptr": "*i64", "values_ptr": "*fp32" if log_softmax else "*bf16",
        "columns_ptr": "*i64", "stats_ptr": "*fp32", "arrivals_ptr": "*i32", "num_cols": "i32",
        "stride_x": "i32", "stride_out": "i32",
    }  # fmt: skip
    constexprs = dict(K=5, BLOCK=2048, TWO_STAGES=two_stages, LOG_SOFTMAX=log_softmax,
                      CHUNKS=8, MERGE_BLOCK=64, K_POW2=8, BY_SORT=by_sort)  # fmt: skip
    ptx = compile_for_hopper(_topk_kernel, signature, constexprs)
    assert ("atom.global" in ptx) == two_stages


INTERPRET_CASES = (
    # (rows, columns, k, ties): one chunk, a partial chunk, several chunks (the second stage)
    (3, 37, 5, True),
    (2, 40, 6, "signed zeros"),
    (2, 1000, 16, False),
    (1, 1, 1, False),
    (2, MAX_CHUNK + 100, 10, True),
    (3, 2 * MAX_CHUNK + 1, 8, False),
    (2, 10 * MAX_CHUNK + 3, MAX_K, True),
)


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the Triton kernels on the CPU vs the reference;
    the arrival counters zeroed again after each launch."""
    from specrun.runtime.kernels.arrivals import arrival_counters
    from specrun.runtime.kernels.topk_triton import TopkConfig, launch_topk, topk_config

    failures = 0
    # The bitonic selection on the shorter cases only (the interpreter sorts slowly), the
    # two-stage merge among them.
    sorted_cases = [case for case in INTERPRET_CASES if case[1] < 4096]
    cases = [(case, False) for case in INTERPRET_CASES] + [(case, True) for case in sorted_cases]
    for i, ((num_rows, num_cols, k, ties), by_sort) in enumerate(cases):
        x = make_rows((num_rows, num_cols), dtype=torch.float32, seed=i, ties=ties)
        form = topk_config(num_rows, num_cols)
        form = TopkConfig(form.block, form.num_warps, by_sort)
        values, columns = launch_topk(x, k, config=form)
        want_values, want_columns = topk_ref(x, k)
        ok = torch.equal(values, want_values) and torch.equal(columns, want_columns)
        x[:, 0] = 0.0  # log-softmax rows need a finite entry
        values, columns = launch_topk(x, k, log_softmax=True, config=form)
        want_values, want_columns = log_softmax_topk_ref(x, k)
        ok = ok and torch.equal(columns, want_columns)
        ok = ok and torch.allclose(values, want_values, rtol=1e-5, atol=1e-5)
        ok = ok and not arrival_counters(x, 1).any()  # every launch leaves them zeroed
        failures += not ok
        print(f"case {i}: {num_rows}x{num_cols} k={k} ties={ties} sort={by_sort} "
              f"{'ok' if ok else 'FAIL'}")  # fmt: skip
    # The narrowest chunks `specrun bench topk --sweep` tries: many chunks, one warp each.
    x = make_rows((3, 1000), dtype=torch.float32, seed=9, ties=True)
    x[:, 0] = 0.0
    values, columns = launch_topk(x, 12, log_softmax=True, config=TopkConfig(256, 1))
    want_values, want_columns = log_softmax_topk_ref(x, 12)
    narrow_ok = torch.equal(columns, want_columns)
    narrow_ok = narrow_ok and torch.allclose(values, want_values, rtol=1e-5, atol=1e-5)
    print(f"narrow chunks: {'ok' if narrow_ok else 'FAIL'}")
    return 1 if failures or not narrow_ok else 0


# GPU tier ---------------------------------------------------------------------------------------

GPU_CASES = [
    # rows, columns, k
    pytest.param(8, 8192, 8, id="draft-frontier"),
    pytest.param(1, 8192, 10, id="draft-root"),
    pytest.param(64, 32000, 8, id="8b-draft-vocab"),
    pytest.param(3, 49152, 16, id="two-stage"),
    pytest.param(5, 128256, MAX_K, id="llama3-vocab-max-k"),
    pytest.param(7, 33, 1, id="tiny"),
    pytest.param(2, 8193, 5, id="chunk-plus-one"),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "num_cols", "k"), GPU_CASES)
def test_gpu_kernel_matches_reference(num_rows, num_cols, k, dtype, ties):
    x = make_rows((num_rows, num_cols), dtype=dtype, seed=num_cols, ties=ties, device="cuda")
    assert_matches_reference(*topk(x, k), x, k)
    x[:, 0] = 0.0
    assert_log_probs_match(*log_softmax_topk(x, k), x, k)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize(("num_rows", "num_cols", "k"), GPU_CASES)
def test_gpu_bitonic_selection_matches_reference(num_rows, num_cols, k, ties):
    """The launch form that selects by one bitonic top-k (`by_sort`), at the chunk width
    `topk_config` picks and at the narrowest the sweep tries (where its merge stays small)."""
    from specrun.runtime.kernels.topk_triton import TopkConfig, launch_topk, topk_config

    x = make_rows((num_rows, num_cols), dtype=torch.bfloat16, seed=k, ties=ties, device="cuda")
    picked = topk_config(num_rows, num_cols)
    forms = [TopkConfig(picked.block, picked.num_warps, True)]
    if -(-num_cols // 256) * k <= 8192:  # the sweep's bound on a merge's keys
        forms.append(TopkConfig(256, 1, True))
    for form in forms:
        assert_matches_reference(*launch_topk(x, k, config=form), x, k)
        x[:, 0] = 0.0
        assert_log_probs_match(*launch_topk(x, k, log_softmax=True, config=form), x, k)


@pytest.mark.gpu
@needs_cuda
def test_gpu_batched_rows_under_compile_and_in_a_cuda_graph():
    x = make_rows((2, 8, 8192), dtype=torch.float32, seed=1, ties=False, device="cuda")

    def top_of_doubled(logits):
        return topk(logits * 2, 8)  # exact, so the reference sees the same values

    compiled = torch.compile(top_of_doubled, fullgraph=True)
    assert_matches_reference(*compiled(x), x * 2, 8)
    topk(x, 8)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, columns = topk(x, 8)
    x.copy_(make_rows(x.shape, dtype=x.dtype, seed=2, ties=True, device="cuda"))
    graph.replay()
    assert_matches_reference(values, columns, x, 8)


if __name__ == "__main__":
    sys.exit(_interpret_main())
