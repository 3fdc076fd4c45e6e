"""The host-side arithmetic of `specrun bench decode` (the benchmark itself needs a GPU): GPU
idle time from kernel spans, and the per-round kernel table."""

from __future__ import annotations

import pytest

from specrun.tools.bench import format_kernel_table
from specrun.tools.decode_bench import KernelSpan, idle_fraction, kernel_table


def _spans(*spans: tuple[str, float, float]) -> list[KernelSpan]:
    return [KernelSpan(*span) for span in spans]


def test_idle_fraction_counts_gaps_once_and_overlaps_as_busy():
    assert idle_fraction([]) is None
    assert idle_fraction(_spans(("a", 0, 1), ("b", 2, 3))) == pytest.approx(1 / 3)
    # b runs inside a, c overlaps a's end: busy [0, 5] and [6, 8] of a span of 8.
    spans = _spans(("a", 0, 4), ("b", 1, 2), ("c", 3, 5), ("d", 6, 8))
    assert idle_fraction(spans) == pytest.approx(1 / 8)


def test_kernel_table_is_per_round_and_costliest_first():
    spans = _spans(("gemm", 0, 4), ("norm", 4, 5), ("gemm", 5, 9), ("norm", 9, 10))
    table = kernel_table(spans, num_rounds=2, top=1)
    assert table["kernels_per_round"] == 2
    assert table["kernel_us_per_round"] == pytest.approx(5)
    assert table["top_kernels"] == [["gemm", 1.0, 4.0]]
    point = {"bucket": 1, "mode": "plain", "tree": None, "round_ms": 0.005,
             "gpu_idle_in_graph": 0.0, **table}  # fmt: skip
    text = format_kernel_table(point)
    assert "2 kernels" in text and "gemm" in text and "norm" not in text
    assert "prefill" not in text
    assert "prefill of 64 tokens: 3.50 ms" in format_kernel_table(
        point | {"prompt_length": 64, "prefill_ms": 3.5}
    )
