"""The host-side arithmetic of `specrun bench decode` (the benchmark itself needs a GPU): GPU
idle time from kernel spans, the per-round kernel table and timeline, and the random shard a
tensor-parallel rank builds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from specrun.models.tensor_parallel import Sharding
from specrun.tools.cli import build_parser
from specrun.tools.decode_cli import format_kernel_table, target_config
from specrun.tools.random_models import SHAPES, random_target
from specrun.tools.round_timing import (
    KernelSpan,
    attention_segments,
    idle_fraction,
    kernel_table,
    round_timeline,
)
from tiny_models import prompt_logits, tiny_config


def _spans(*spans: tuple[str, float, float]) -> list[KernelSpan]:
    return [KernelSpan(*span) for span in spans]


def test_idle_fraction_counts_gaps_once_and_overlaps_as_busy():
    assert idle_fraction([]) is None
    assert idle_fraction(_spans(("a", 0, 1), ("b", 2, 3))) == pytest.approx(1 / 3)
    # b runs inside a, c overlaps a's end: busy [0, 5] and [6, 8] of a span of 8.
    spans = _spans(("a", 0, 4), ("b", 1, 2), ("c", 3, 5), ("d", 6, 8))
    assert idle_fraction(spans) == pytest.approx(1 / 8)


def test_the_timeline_is_the_middle_rounds_kernels_in_order_from_its_start():
    rounds = [(f"k{i}", 10.0 * r + i, 10.0 * r + i + 0.5 * (r + 1)) for r in range(3)
              for i in range(2)]  # fmt: skip
    timeline = round_timeline(_spans(*rounds), num_rounds=3)
    assert timeline == [["k0", 0.0, 1.0], ["k1", 1.0, 1.0]]  # round 1 of 0-2
    assert round_timeline(_spans(*rounds[:-1]), num_rounds=3) == []  # a kernel went missing
    assert round_timeline([], num_rounds=2) == []


def test_a_round_is_cut_after_each_attention_launch_with_its_gaps():
    timeline = [["norm", 0.0, 1.0], ["_tree_attention_kernel", 2.0, 3.0], ["mm", 6.0, 1.0],
                ["_tree_attention_kernel", 8.0, 2.0], ["argmax", 11.0, 0.5]]  # fmt: skip
    assert attention_segments(timeline) == [[2, 4.0, 5.0], [2, 3.0, 5.0], [1, 0.5, 1.5]]
    assert attention_segments(timeline[:2]) == [[2, 4.0, 5.0]]  # nothing after the last
    assert attention_segments([]) == []
    point = {"bucket": 1, "mode": "speculative", "tree": [2, 2, 3], "round_ms": 0.0115,
             "kernels_per_round": 5, "kernel_us_per_round": 7.5, "gpu_idle_in_graph": 0.3,
             "top_kernels": [], "kernel_timeline": timeline}  # fmt: skip
    assert "cut after each attention (us, gaps included): 5.0 5.0 1.5" in format_kernel_table(point)


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
    assert "draft phase" not in text


def test_a_rounds_kernel_table_lists_the_draft_phases_own_kernels_after_it():
    round_spans = _spans(("gemm", 0, 4), ("topk", 4, 5), ("attention", 5, 7))
    draft_spans = _spans(("topk", 0, 1), ("gemm", 1, 2), ("topk", 2, 3), ("gemm", 3, 4))
    draft = kernel_table(draft_spans, num_rounds=2, top=1)
    point = {"bucket": 1, "mode": "speculative", "tree": [6, 8, 40], "round_ms": 0.007,
             "gpu_idle_in_graph": 0.0, "draft_ms": 0.002,
             **kernel_table(round_spans, num_rounds=1, top=3),
             **{f"draft_{key}": value for key, value in draft.items()}}  # fmt: skip
    text = format_kernel_table(point)
    head, draft_part = text.split("of which the draft phase alone")
    assert "attention" in head and "attention" not in draft_part
    assert ": 0.002 ms, 2 kernels, 2 us in kernels" in draft_part
    assert draft_part.count("x  ") == 1 and "1.0x  " in draft_part


def test_a_random_shard_from_the_same_seed_is_the_random_model():
    """`bench decode --tp N` ranks build their shards from one seed; over one rank (a gloo
    group of this process alone) the shard is the whole model's weights, drawn alike."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        config = tiny_config(vocab_size=98)
        torch.manual_seed(0)
        shard = random_target(config, device="cpu", dtype=torch.float32, sharding=Sharding(0, 1))
        torch.manual_seed(0)
        whole = random_target(config, device="cpu", dtype=torch.float32)
        assert type(shard.embed_tokens).__name__ == "VocabParallelEmbedding"
        torch.testing.assert_close(prompt_logits(shard, [1, 2, 3]), prompt_logits(whole, [1, 2, 3]))
    finally:
        dist.destroy_process_group()


def test_num_layers_keeps_the_first_layers_of_the_shapes():
    parse = build_parser().parse_args
    shapes = SHAPES["smollm2-135m"].target
    assert target_config(parse(["bench", "decode", "--shapes", "smollm2-135m"])) == shapes
    two = target_config(parse(["bench", "decode", "--shapes", "smollm2-135m", "--num-layers", "2"]))
    assert two.num_layers == 2 and two.hidden_size == shapes.hidden_size
    for bad in ("0", str(shapes.num_layers + 1)):
        args = parse(["bench", "decode", "--shapes", "smollm2-135m", "--num-layers", bad])
        with pytest.raises(ValueError, match="--num-layers must be in"):
            target_config(args)
