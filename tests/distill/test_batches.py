"""Training batches: a pure function of (seed, step); with length groups, runs of steps cut
from one draw sorted by length into batches of about equal response tokens, so a batch pads
less than a random draw does."""

from __future__ import annotations

import itertools

import pytest
import torch

from specrun.runtime.distill.data import TrainingSequence, sample_batch
from specrun.runtime.distill.trainer import TrainConfig


def _sequences(num: int, *, seed: int = 0) -> list[TrainingSequence]:
    """Sequences of distinct lengths 2..num+1 in a random order, each row's ids all its
    length (so a batch row names the sequence it came from)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.randperm(num, generator=generator) + 2).tolist()
    return [TrainingSequence(token_ids=(n,) * n, num_prompt=1) for n in lengths]


def _rows(batch) -> list[int]:
    return batch.tokens[:, 0].tolist()


@pytest.mark.parametrize("length_groups", [1, 4])
def test_a_batch_is_a_pure_function_of_seed_and_step(length_groups):
    sequences = _sequences(300)
    options = {"batch_size": 6, "max_length": 512, "length_groups": length_groups}
    first = sample_batch(sequences, seed=3, step=5, **options)
    again = sample_batch(sequences, seed=3, step=5, **options)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.lengths, again.lengths)
    assert _rows(sample_batch(sequences, seed=4, step=5, **options)) != _rows(first)
    assert _rows(sample_batch(sequences, seed=3, step=6, **options)) != _rows(first)


def test_length_groups_cut_one_sorted_draw_into_batches_of_equal_tokens():
    sequences, num_groups, batch_size = _sequences(400), 4, 5
    options = {"batch_size": batch_size, "max_length": 512, "length_groups": num_groups}
    shuffled = False
    for run in range(3):
        steps = range(run * num_groups, (run + 1) * num_groups)
        batches = [sample_batch(sequences, seed=1, step=s, **options) for s in steps]
        rows = [_rows(batch) for batch in batches]
        assert sum(map(len, rows)) == num_groups * batch_size
        # The run's batches hold disjoint length ranges: one draw, sorted, cut in four...
        spans = sorted((min(r), max(r)) for r in rows)
        assert all(low >= high for (_, high), (low, _) in itertools.pairwise(spans))
        # ...where each batch's response tokens reach the run's share within one sequence.
        tokens = [int(batch.loss_mask.sum()) for batch in batches]
        share = sum(tokens) / num_groups
        assert all(abs(count - share) <= max(map(max, rows)) for count in tokens), tokens
        # ...and taken in a random order, not shortest first in every run.
        shuffled |= [min(r) for r in rows] != sorted(min(r) for r in rows)
    assert shuffled


def test_length_groups_pad_less_than_random_draws():
    sequences = _sequences(500, seed=2)

    def real_fraction(length_groups: int) -> float:
        options = {"batch_size": 8, "max_length": 512, "length_groups": length_groups}
        batches = [sample_batch(sequences, seed=0, step=step, **options) for step in range(64)]
        return sum(int(b.lengths.sum()) for b in batches) / sum(b.tokens.numel() for b in batches)

    # Uniform lengths: a random draw of 8 pads to its longest, about 8/9 of the range, so
    # about half of its tokens are real; sorted groups of 16 x 8 pad to their own rows.
    assert real_fraction(1) < 0.65
    assert real_fraction(16) > 0.9


def test_length_groups_must_be_positive():
    with pytest.raises(ValueError, match="length_groups"):
        TrainConfig(length_groups=0)
