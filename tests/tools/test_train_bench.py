"""`specrun bench train-draft` on the CPU with a tiny target: the phases run, the timed counts
are the ones after the warm-up, and bad counts are refused before any model is built."""

import pytest
import torch

from specrun.runtime.distill.trainer import TrainConfig
from specrun.tools.cli import main
from specrun.tools.round_timing import KernelSpan
from specrun.tools.train_bench import summary, train_bench_point
from tiny_models import tiny_config


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_answering_and_training_rates_of_a_tiny_target(kind):
    config = TrainConfig(
        kind=kind,
        num_steps=3,
        batch_size=2,
        num_ttt_steps=2,
        draft_vocab_size=40 if kind == "eagle3" else None,
        max_length=16,
        num_heldout=0,
    )
    point = _tiny_point(config, num_prompts=6, max_new_tokens=4)
    assert point["num_prompts"] == point["num_sequences"] == 6
    assert point["train_steps"] == 2 and point["train_steps_per_s"] > 0
    assert point["answer_tokens_per_s"] > 0
    # Random weights never stop early: 4 chunks x 2 prompts x 4 tokens after the first chunk.
    seconds = 4 / point["answer_prompts_per_s"]
    assert point["answer_tokens_per_s"] * seconds == pytest.approx(16)
    assert point["train_peak_gib"] is None and point["head_params"] > 0
    assert point["kind"] == kind and point["draft_vocab"] == config.draft_vocab_size
    assert "steps/s" in summary(point) and "prompts/s" in summary(point)
    assert "profiled step" not in summary(point)


def test_profiled_steps_report_their_kernels(monkeypatch):
    """--profile-steps: that many more steps run through the profiler (here a stand-in that
    runs them and reports two kernels a step), and the point holds their table."""
    calls = []

    def profile_kernels(run, *, num_rounds, host_loop):
        spans = []
        for i in range(num_rounds):
            run()
            calls.append(i)
            spans += [
                KernelSpan("gemm", 100.0 * i, 100.0 * i + 30),
                KernelSpan("add", 100.0 * i + 40, 100.0 * i + 50),
            ]
        return spans

    monkeypatch.setattr("specrun.tools.train_bench.profile_kernels", profile_kernels)
    config = TrainConfig(num_steps=2, batch_size=2, draft_vocab_size=40, max_length=16)
    point = _tiny_point(config, num_prompts=4, max_new_tokens=2, num_profile_steps=3)
    assert calls == [0, 1, 2] and point["train_profile_steps"] == 3
    assert point["train_kernels_per_step"] == 2
    assert point["train_kernel_ms_per_step"] == pytest.approx(0.04)
    assert point["train_top_kernels"] == [["gemm", 1.0, 30.0], ["add", 1.0, 10.0]]
    assert point["train_gpu_idle"] == pytest.approx(1 - 120 / 250)
    assert "profiled step: 2 kernels" in summary(point)


def test_summary_lists_a_profiled_steps_kernels():
    point = {
        "answer_tokens_per_s": 100.0, "answer_prompts_per_s": 2.0, "generate_batch_size": 8,
        "max_new_tokens": 16, "answer_first_chunk_s": 3.0, "kind": "eagle3",
        "train_batch_size": 4, "max_length": 32, "ttt_steps": 2, "train_steps_per_s": 5.0,
        "train_peak_gib": 1.5, "train_profile_steps": 2, "train_gpu_idle": 0.75,
        "train_kernels_per_step": 812.0, "train_kernel_ms_per_step": 50.0,
        "train_top_kernels": [["gemm_a", 14.0, 20000.0], ["softmax_b", 7.0, 9000.0]],
    }  # fmt: skip
    lines = summary(point).splitlines()
    assert lines[2] == (
        "profiled step: 812 kernels, 50.0 ms in kernels against 200.0 ms a step, "
        "GPU idle 75% of the profiled span"
    )
    assert lines[3].split() == ["20.00", "ms", "14x", "gemm_a"]
    assert lines[4].split() == ["9.00", "ms", "7x", "softmax_b"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "100", "--generate-batch-size", "64"], "at least twice"),
        (["--steps", "0"], "--steps"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
        (["--profile-steps", "2"], "--profile-steps profiles CUDA kernels"),
    ],
)
def test_bad_counts_are_refused_before_any_model_is_built(argv, message, capsys):
    assert main(["bench", "train-draft", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_training_that_runs_out_of_memory_says_what_to_lower(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("specrun.tools.train_bench.train_step", out_of_memory)
    config = TrainConfig(num_steps=2, batch_size=2, draft_vocab_size=40, max_length=16)
    with pytest.raises(ValueError, match="lower --batch-size or --max-length"):
        _tiny_point(config, num_prompts=4, max_new_tokens=2)


def _tiny_point(
    config: TrainConfig, *, num_prompts: int, max_new_tokens: int, num_profile_steps: int = 0
) -> dict:
    return train_bench_point(
        tiny_config(num_layers=4),
        config,
        device="cpu",
        dtype=torch.float32,
        num_prompts=num_prompts,
        prompt_length=5,
        max_new_tokens=max_new_tokens,
        generate_batch_size=2,
        num_warmup_steps=1,
        num_profile_steps=num_profile_steps,
    )
