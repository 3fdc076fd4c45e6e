"""`specrun bench train-draft` on the CPU with a tiny target: the phases run, the timed counts
are the ones after the warm-up, and bad counts are refused before any model is built."""

import pytest
import torch

from specrun.runtime.distill.trainer import TrainConfig
from specrun.tools.cli import main
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompts", "100", "--generate-batch-size", "64"], "at least twice"),
        (["--steps", "0"], "--steps"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
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


def _tiny_point(config: TrainConfig, *, num_prompts: int, max_new_tokens: int) -> dict:
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
    )
