"""Acceptance estimates on the host alone: the chain model and its inversion, what a head's
measured acceptance starts the running means at, how a request's estimate follows what it
accepts (and drifts back over plain rounds), the running means per kind of request (of rounds,
then of finished requests), and the
root signals a round reports. The policies that read them: tests/runtime/test_policy.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specrun.runtime.acceptance import (
    PRIOR_REQUEST_RATE,
    SPREAD_MIN,
    SPREAD_ROUNDS,
    STALE_RATE,
    AcceptanceBook,
    MeasuredAcceptance,
    alpha_for,
    alpha_of_chain,
    chain_acceptance,
    chain_length,
    expected_accepted,
    level_width,
)
from specrun.runtime.policies import tree_ladder
from specrun.runtime.round import acceptance_signals
from specrun.runtime.tree import TreeShape

DEEP = TreeShape(6, 8, 40)


def test_the_acceptance_model_is_monotone_and_inverts():
    """Wider and deeper trees accept more of the same draft; a level's acceptance maps back
    to the chain acceptance it came from."""
    assert level_width(DEEP) == 6.5 and level_width(TreeShape(3, 2, 4)) == 1.0
    for alpha in (0.1, 0.5, 0.9):
        lengths = [expected_accepted(alpha, tree) for tree in tree_ladder(DEEP)]
        assert lengths == sorted(lengths, reverse=True) and lengths[-1] == 0.0
        level = 1 - (1 - alpha) ** 3
        assert chain_acceptance(level, 3) == pytest.approx(alpha)
    assert expected_accepted(1.0, DEEP) == DEEP.depth


def test_a_measured_acceptance_is_what_its_priors_expect_of_its_tree():
    """The alpha a head's measured tokens per round map to gives them back for that tree,
    and rates a tree cannot reach are refused."""
    for accepted in (0.0, 0.4, 2.5, 5.9):
        assert expected_accepted(alpha_for(accepted, DEEP), DEEP) == pytest.approx(accepted)
    measured = MeasuredAcceptance(DEEP, greedy=4.1, sampling=1.93)
    priors = measured.priors()
    assert expected_accepted(priors[True], DEEP) == pytest.approx(3.1)
    sampled = dataclasses.replace(DEEP, stochastic=True)
    assert expected_accepted(priors[False], sampled) == pytest.approx(0.93)
    assert MeasuredAcceptance(DEEP, sampling=1.5).priors().keys() == {False}
    for rate in (0.5, DEEP.depth + 1.5):
        with pytest.raises(ValueError, match="tokens per round"):
            MeasuredAcceptance(DEEP, greedy=rate)


def test_estimates_follow_what_requests_accept():
    """A request that accepts every level drifts to alpha near 1, one that accepts nothing to
    near 0; plain rounds move a request's estimate slowly back towards the engine's running
    mean, which new requests start at."""
    book = AcceptanceBook()
    for _ in range(30):
        book.observe("good", DEEP, DEEP.depth)
        book.observe("bad", DEEP, 0)
        book.observe("plain", None, 0)
    assert book.get("good").alpha > 0.9 and book.get("bad").alpha < 0.1
    assert book.get("plain").rounds_since_speculation == 30
    assert 0.1 < book.get("newcomer").alpha < 0.9
    assert book.get("newcomer").alpha == book.prior()
    # Too few speculative rounds to have a typical alpha of its own: the kind's mean.
    for _ in range(SPREAD_ROUNDS - 1):
        book.observe("new", DEEP, 0)
    # The drift is geometric in the accepted length of the reference chain.
    gap = chain_length(book.prior()) - chain_length(book.get("new").alpha)
    for _ in range(30):
        book.observe("new", None, 0)
    left = chain_length(book.prior()) - chain_length(book.get("new").alpha)
    assert left == pytest.approx(gap * (1 - STALE_RATE) ** 30)
    for _ in range(500):
        book.observe("new", None, 0)
    assert book.get("new").alpha == pytest.approx(book.prior(), abs=0.01)
    book.forget("good")
    assert "good" not in book.estimates


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimates_expect_what_requests_accept_on_average_whatever_its_spread(seed):
    """Over many rounds, what a request's estimate expects of the tree it runs averages what
    it accepts, for accepted lengths as far from geometric as real ones (most rounds stop at
    the root or run the whole depth) as well as for near-geometric ones."""
    generator = torch.Generator().manual_seed(seed)
    depth = DEEP.depth
    spreads = {
        "all or nothing": torch.tensor([0.45] + [0.02] * (depth - 1) + [0.43]),
        "geometric": torch.tensor([0.7**k * 0.3 for k in range(depth)] + [0.7**depth]),
    }
    for name, probabilities in spreads.items():
        book = AcceptanceBook()
        draws = torch.multinomial(probabilities, 2000, replacement=True, generator=generator)
        expected = []
        for num_accepted in draws.tolist():
            expected.append(book.get(name).expected(DEEP))
            book.observe(name, DEEP, num_accepted)
        mean = (probabilities * torch.arange(depth + 1)).sum().item()
        assert sum(expected[100:]) / len(expected[100:]) == pytest.approx(mean, rel=0.05), name


def test_plain_rounds_bring_a_request_back_to_what_it_typically_accepts():
    """After several rejected rounds in a text it drafts well, a request's estimate recovers
    within about ten plain rounds; one that drafted poorly throughout rises no further than
    its own typical alpha, well below its kind's mean."""
    book = AcceptanceBook()
    for _ in range(12):
        book.observe("dipped", DEEP, DEEP.depth - 1)
        book.observe("poor", DEEP, 0)
    typical = book.get("dipped").typical_alpha
    for _ in range(6):
        book.observe("dipped", DEEP, 0)
    dipped = book.get("dipped").alpha
    assert dipped < 0.65 * typical
    poor = book.get("poor").alpha
    for _ in range(10):
        book.observe("dipped", None, 0)
        book.observe("poor", None, 0)
    recovered = book.get("dipped").alpha
    assert recovered - dipped > 0.6 * (book.get("dipped").typical_alpha - dipped)
    assert poor < book.get("poor").alpha < book.get("poor").typical_alpha < 0.75 * book.prior()


def test_greedy_and_sampling_requests_keep_their_own_running_means():
    """New requests start at their kind's mean, which learns fast from its first rounds; a
    request whose draft was left behind expects nothing of any tree and teaches the means
    nothing."""
    book = AcceptanceBook()
    for _ in range(6):
        book.get("first", kind=False)
        book.observe("first", DEEP, 0)
    assert book.prior(False) < 0.5 and book.prior(True) == book.prior()
    for _ in range(100):
        book.get("greedy", kind=True), book.get("sampled", kind=False)
        book.observe("greedy", DEEP, DEEP.depth)
        book.observe("sampled", DEEP, 0)
    assert book.prior(True) > 0.8 and book.prior(False) < 0.2
    assert book.get("new greedy", kind=True).alpha == book.prior(True)
    stale = book.get("stale", kind=True)
    stale.in_step = False
    before = book.prior(True)
    book.observe("stale", DEEP, 0)
    assert book.prior(True) == before and stale.expected(DEEP) == 0.0


def test_once_requests_finish_a_kinds_mean_weighs_requests_not_rounds():
    """At batch 1 a mean of rounds would be the last request's: once SPREAD_MIN requests of
    a kind have finished, its mean moves by finished requests only, PRIOR_REQUEST_RATE
    each, so one long poor request moves it that much and no more."""
    book = AcceptanceBook()
    for index in range(SPREAD_MIN):
        for _ in range(30):
            book.get(index, kind=True)
            book.observe(index, DEEP, DEEP.depth - 1)
        book.forget(index)
    good = chain_length(book.prior(True))
    for _ in range(200):
        book.get("poor", kind=True)
        book.observe("poor", DEEP, 0)
    assert book.prior(True) == alpha_of_chain(good)
    poor = book.estimates["poor"].typical_length
    book.forget("poor")
    moved = chain_length(book.prior(True))
    assert moved == pytest.approx(good + PRIOR_REQUEST_RATE * (poor - good))
    assert book.get("next", kind=True).alpha > 0.8 * alpha_of_chain(good)


def test_acceptance_signals_compare_draft_and_target_at_the_root():
    """Confidence is the draft's top probability; the divergence is KL(p || q) with p the
    target's distribution restricted to the draft vocabulary: 0 when they agree there."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(3, 11, generator=generator, dtype=torch.float64)
    draft_to_target = torch.tensor([7, 0, 3, 9, 4])
    same = target.index_select(1, draft_to_target) + 2.0  # a shift leaves softmax alone
    other = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    signals = acceptance_signals(target, same, draft_to_target)
    q = same.softmax(-1)
    torch.testing.assert_close(signals[:, 0], q.amax(-1).float())
    torch.testing.assert_close(signals[:, 1], torch.zeros(3), atol=1e-5, rtol=0)
    p = target.softmax(-1).index_select(1, draft_to_target)
    p = p / p.sum(-1, keepdim=True)
    want = (p * (p.log() - other.log_softmax(-1))).sum(-1)
    got = acceptance_signals(target, other, draft_to_target)[:, 1]
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    assert bool((got > 0).all())
    # A draft that brings its logsumexp (Tree.root_log_norm) gets the same signals.
    norm = other.float().logsumexp(-1)
    with_norm = acceptance_signals(target, other, draft_to_target, draft_log_norm=norm)
    torch.testing.assert_close(with_norm, acceptance_signals(target, other, draft_to_target))
