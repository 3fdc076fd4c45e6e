"""`draw_tokens`: one pass over the logits draws what `sample(target_probs(...))` draws.

Per slot: greedy rows give the argmax (the first on ties, as the one-hot does), sampled rows
follow softmax(logits / T) (Pearson's chi-square over many draws), a batch mixes both, and
with top-k / top-p on the draw goes through the filtered distribution.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from goodness_of_fit import chi_square_p_value
from specrun.runtime.config import SamplingParams
from specrun.runtime.rng import Site
from specrun.runtime.sampling import SamplingTensors, draw_tokens, sample, target_probs

VOCAB = 7
NUM_DRAWS = 40_000


def _sampling(*params: SamplingParams, rows: int = 1) -> SamplingTensors:
    """Per-slot tensors of `params`, each repeated for `rows` consecutive slots with seeds
    of their own (slots with one seed draw the same numbers)."""
    seeded = [
        dataclasses.replace(p, seed=index)
        for index, p in enumerate(p for p in params for _ in range(rows))
    ]
    return SamplingTensors.from_params(seeded, "cpu")


def _p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = dict(enumerate(torch.bincount(tokens, minlength=VOCAB).tolist()))
    return chi_square_p_value(counts, dict(enumerate(probs.tolist())), tokens.numel())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_sampled_rows_follow_the_tempered_softmax(temperature):
    gen = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(VOCAB, generator=gen, dtype=torch.float64).to(torch.bfloat16) * 2
    sampling = _sampling(SamplingParams(temperature=temperature), rows=NUM_DRAWS)
    tokens = draw_tokens(logits.expand(NUM_DRAWS, VOCAB), sampling)
    assert tokens.shape == (NUM_DRAWS,) and tokens.dtype == torch.int64
    want = torch.softmax(logits.double() / temperature, dim=-1)
    assert _p_value(tokens, want) > 1e-4


def test_greedy_rows_take_the_first_argmax_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, VOCAB, generator=gen)
    logits[0, :, 2] = logits[0, :, 5] = logits[0].max() + 1  # a tie: the first index wins
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 0.7, 0.0, 2.0)]
    sampling = SamplingTensors.from_params(params, "cpu")
    tokens = draw_tokens(logits, sampling)
    assert tokens.shape == (6, 5)
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert (tokens[0] == 2).all()
    counter = sampling.counter().view(-1, 1).expand(6, 5)
    drawn = sample(target_probs(logits, sampling), sampling.seed, counter, site=Site.TARGET)
    assert torch.equal(tokens[greedy], drawn[greedy])


def test_the_sampled_rows_of_a_mixed_batch_follow_their_own_temperatures():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(VOCAB, generator=gen)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)
    sampling = _sampling(greedy, hot, rows=NUM_DRAWS)
    tokens = draw_tokens(logits.expand(2 * NUM_DRAWS, VOCAB), sampling)
    assert (tokens[:NUM_DRAWS] == logits.argmax()).all()
    assert _p_value(tokens[NUM_DRAWS:], torch.softmax(logits.double() / 1.3, -1)) > 1e-4


def test_top_k_and_top_p_draw_from_the_filtered_distribution():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(VOCAB, generator=gen)
    sampling = _sampling(SamplingParams(temperature=1.0, top_k=3, top_p=0.9), rows=NUM_DRAWS)
    tokens = draw_tokens(logits.expand(NUM_DRAWS, VOCAB), sampling)
    want = target_probs(
        logits[None], _sampling(SamplingParams(temperature=1.0, top_k=3, top_p=0.9))
    )
    assert int((want[0] > 0).sum()) <= 3
    assert _p_value(tokens, want[0].double()) > 1e-4


@pytest.mark.parametrize("vocab", [1, 5, 1024, 1025, 3000])
def test_greedy_draws_match_argmax_across_chunks(vocab):
    """Rows longer than one 1024-column chunk, ties across chunks included."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen)
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1
    logits[2] = 0.5  # every column ties: the first wins
    greedy = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 4, "cpu")
    assert torch.equal(draw_tokens(logits, greedy), logits.argmax(-1))


def test_a_greedy_batchs_draws_take_the_argmax_without_drawing_noise(monkeypatch):
    """`SamplingTensors.greedy` (a greedy batch's round variant) skips the noise even where
    the temperatures cannot be read on the host (a compiled, captured round)."""
    from specrun.runtime import sampling as sampling_module

    def no_noise(*args, **kwargs):
        raise AssertionError("a greedy batch drew noise")

    monkeypatch.setattr(sampling_module, "readable_on_host", lambda tensor: False)
    monkeypatch.setattr(sampling_module, "gumbel", no_noise)
    logits = torch.randn(3, 5, 2000, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0)] * 3
    greedy = dataclasses.replace(SamplingTensors.from_params(params, "cpu"), greedy=True)
    assert torch.equal(draw_tokens(logits, greedy), logits.argmax(-1))
    with pytest.raises(AssertionError, match="drew noise"):
        draw_tokens(logits, dataclasses.replace(greedy, greedy=False))
