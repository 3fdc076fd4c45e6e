"""The host side of `specrun bench kernels`, `skinny-mm`, `topk` and `gpt-fast` (all time on a
GPU): the configs a sweep tries, the benchmark grid, the summary row, and the argument checks
that come before any device work."""

from __future__ import annotations

import pytest

from specrun.runtime.kernels.skinny_mm import MAX_ROWS
from specrun.tools import kernel_bench
from specrun.tools.bench import _row as kernels_row
from specrun.tools.cli import main
from specrun.tools.random_models import SHAPES
from specrun.tools.skinny_mm_bench import row, sweep_configs
from specrun.tools.topk_bench import DEFAULT_POINTS, parse_point
from specrun.tools.topk_bench import row as topk_row
from specrun.tools.topk_bench import sweep_configs as topk_sweep_configs


def test_a_sweep_tries_tensor_core_tiles_only_where_tl_dot_takes_them():
    dot, one_row = sweep_configs(8), sweep_configs(1)
    assert dot and one_row and len(set(dot)) == len(dot)
    assert all(c.use_dot and c.block_n >= 16 and c.block_k >= 16 for c in dot)
    assert not any(c.use_dot for c in one_row)


def test_a_row_names_the_shape_and_every_contender_that_ran():
    best = {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 5}
    point = {"shape": "o", "n": 4096, "k": 4096, "rows": 4, "cublas_gbps": 2043.2,
             "rt_gbps": 2280.4, "best_gbps": 2341.0, "best_config": best}  # fmt: skip
    text = row(point)
    assert text.split()[:3] == ["o", "4096x4096", "4"]
    assert "2043" in text and "2280" in text and "2341" in text and "n16 k256 w4 s5" in text
    assert text.split()[4] == "-"  # inductor did not run at 4 rows


def test_tree_attention_grid_takes_a_models_heads_and_a_cache_larger_than_the_prefix():
    smollm2 = SHAPES["smollm2-135m"].target
    shapes = kernel_bench.tree_attention_shapes(
        batches=[1], lengths=[256, 1024], trees=[40], config=smollm2, cache_size=4512
    )
    assert [s.cache_len for s in shapes] == [256, 1024]
    first = shapes[0]
    assert (first.num_q_heads, first.num_kv_heads, first.head_dim) == (9, 3, 64)
    assert first.num_positions == 4512 and first.num_rows == 120
    # The floor counts the committed keys only; the memory check, the whole cache.
    assert first.input_bytes() > first.floor_bytes()
    default = kernel_bench.tree_attention_shapes(batches=[2], lengths=[512], trees=[8])[0]
    assert default.num_positions == 512 and default.num_rows == 32  # 8B: 4 heads per KV head


def test_a_tree_attention_sweep_tries_row_tiles_up_to_the_rows_it_has():
    one_query = kernel_bench.TreeAttentionShape(batch=1, cache_len=256, num_tree=1)
    many = kernel_bench.TreeAttentionShape(batch=1, cache_len=256, num_tree=60)
    few, lots = kernel_bench.sweep_configs(one_query), kernel_bench.sweep_configs(many)
    assert {c.block_r for c in few} == {16} and {c.block_r for c in lots} == {16, 32, 64}
    assert len(set(lots)) == len(lots) and {c.num_splits for c in lots} == {1, 2, 4, 8, 16, 32}


def test_a_kernels_row_shows_the_sweeps_best_config_where_one_ran():
    point = {"num_tree": 40, "cache_len": 256, "batch": 1, "floor_us": 1.0, "kernel_us": 8.0,
             "floor_fraction": 0.125, "sdpa_gqa_us": 30.0, "sdpa_expanded_us": None,
             "config": {"num_splits": 6}, "meets_floor_target": True,
             "beats_sdpa": True}  # fmt: skip
    assert "r16" not in kernels_row(point)
    best = {"block_r": 16, "block_n": 64, "num_splits": 4}
    assert kernels_row(point | {"best_us": 7.5, "best_config": best}).endswith("7.5 r16/n64/s4")


def test_topk_points_parse_and_sweeps_keep_merges_small():
    point = parse_point("8,14336,8,lsm")
    assert (point.num_rows, point.num_cols, point.k, point.log_softmax) == (8, 14336, 8, True)
    assert not parse_point("1,328,40").log_softmax
    pytest.importorskip("triton")
    for each in (*DEFAULT_POINTS, parse_point("4,128256,64")):
        configs = topk_sweep_configs(each)
        assert configs and len(set(configs)) == len(configs)
        assert all(-(-each.num_cols // c.block) * each.k <= 8192 for c in configs)
    # A row no wider than 328 columns is never split into chunks wider than 512.
    rerank = topk_sweep_configs(parse_point("1,328,40"))
    assert {c.block for c in rerank} <= {256, 512}
    assert {c.by_sort for c in rerank} == {False, True}


@pytest.mark.parametrize(("text", "message"), [("8,14336", "ROWS,COLS,K"), ("1,10,11", "1 <= K")])
def test_bad_topk_points_are_refused_by_the_parser(text, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "topk", "--points", text])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_topk_row_shows_both_launch_forms_and_a_mismatch():
    point = {"name": "level", "num_rows": 8, "num_cols": 14336, "k": 8, "log_softmax": True,
             "aten_us": 90.3, "rt_us": 6.9, "best_us": 5.9, "rt_matches_aten": True,
             "config": {"block": 512, "num_warps": 2, "by_sort": False},
             "best_config": {"block": 256, "num_warps": 1, "by_sort": True}}  # fmt: skip
    text = topk_row(point)
    assert text.split()[:4] == ["level", "8x14336", "k=8", "lsm"]
    assert "90.3" in text and "6.9" in text and text.endswith("b512 w2 best b256 w1 sort")
    assert topk_row(point | {"rt_matches_aten": False}).endswith("MISMATCH")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "skinny-mm", "--shapes", "qkv", "attn"], "unknown --shapes"),
        (["bench", "skinny-mm", "--rows", "1", str(MAX_ROWS + 1)], "--rows"),
        (["bench", "gpt-fast", "--path", "/nonexistent"], "no gpt-fast checkout"),
        (["bench", "kernels", "--lengths", "512", "8192", "--cache-size", "4096"], "below"),
    ],
)
def test_bad_arguments_are_refused_before_any_device_work(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
