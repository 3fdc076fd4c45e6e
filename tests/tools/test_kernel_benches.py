"""The host side of `specrun bench skinny-mm` and `specrun bench gpt-fast` (both time on a GPU):
the tilings a sweep tries, the summary row, and the argument checks that come before any
device work."""

from __future__ import annotations

import pytest

from specrun.runtime.kernels.skinny_mm import MAX_ROWS
from specrun.tools.cli import main
from specrun.tools.skinny_mm_bench import row, sweep_configs


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "skinny-mm", "--shapes", "qkv", "attn"], "unknown --shapes"),
        (["bench", "skinny-mm", "--rows", "1", str(MAX_ROWS + 1)], "--rows"),
        (["bench", "gpt-fast", "--path", "/nonexistent"], "no gpt-fast checkout"),
    ],
)
def test_bad_arguments_are_refused_before_any_device_work(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
