"""Speculation policies on the host alone: given round costs and acceptance histories, which
shape each policy picks, and that it does not flap. The estimates they read:
tests/runtime/test_acceptance_estimates.py; losslessness under shapes changing between
rounds: tests/runtime/test_adaptive_rounds.py."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

import pytest

from specrun.runtime.acceptance import (
    SETTLED_PRIOR_ROUNDS,
    SPREAD_ROUNDS,
    AcceptanceBook,
    AcceptanceEstimate,
    MeasuredAcceptance,
    RoundCosts,
    alpha_for,
    chain_length,
    expected_accepted,
)
from specrun.runtime.config import POLICY_NAMES, EngineConfig, SamplingParams
from specrun.runtime.policies import (
    POLICIES,
    CostPolicy,
    dsde_length,
    make_policy,
    tree_ladder,
)
from specrun.runtime.policies.cost import (
    EXPLORE_EVERY,
    EXPLORE_SHARE,
    HYSTERESIS,
    IN_STEP_COST,
    PLAIN_HYSTERESIS,
)
from specrun.runtime.round_plan import RoundPlanner, RoundVariant
from specrun.runtime.tree import TreeShape

DEEP = TreeShape(6, 8, 40)
LADDER = [RoundVariant(tree=tree) for tree in tree_ladder(DEEP)]
PLAIN = LADDER[-1]
# Seconds per round at batch 1 on a GPU-like device: the deep tree costs 2.2 plain steps.
GPU_COSTS = {DEEP: 2.2, LADDER[1].tree: 1.6, LADDER[2].tree: 1.4, None: 1.0}


def _costs(seconds_by_tree: dict) -> RoundCosts:
    costs = RoundCosts()
    for variant in LADDER:
        for _ in range(2):  # the first run is not counted
            costs.observe(1, variant, seconds_by_tree[variant.tree])
    return costs


def _estimate(alpha: float) -> AcceptanceEstimate:
    return AcceptanceEstimate(alpha=alpha)


def test_the_policy_names_are_the_configs():
    assert set(POLICIES) == set(POLICY_NAMES)
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineConfig(policy="greedy")


def test_cost_decodes_plainly_from_the_first_round_for_a_kind_measured_hopeless():
    """New sampling requests of a head measured to accept little at temperature 1 run bare
    plain steps from their first round; without the measurement the generic prior sends
    them through trees first."""
    measured = MeasuredAcceptance(DEEP, sampling=1.3)

    def tree_rounds(book: AcceptanceBook) -> tuple[int, tuple]:
        policy, costs, num_trees = CostPolicy(), _costs(GPU_COSTS), 0
        for round_index in range(20):
            estimate = book.get(0, kind=False)
            chosen = policy.choose(1, LADDER, [estimate], costs)
            book.observe(0, chosen.tree, 0)
            num_trees += chosen.tree is not None
            if round_index == 0:
                first = (chosen.tree, policy.leaves_draft_behind(1))
        return num_trees, first

    num_trees, first = tree_rounds(AcceptanceBook.starting_from(measured))
    assert num_trees <= 1 and first == (None, True)
    assert tree_rounds(AcceptanceBook.starting_from(None))[0] >= 3


def test_cost_measures_every_shape_once_then_follows_acceptance():
    policy = CostPolicy()
    costs = RoundCosts()
    high = [_estimate(0.9)]
    tried = []
    for _ in range(2 * len(LADDER)):
        chosen = policy.choose(1, LADDER, high, costs)
        tried.append(chosen)
        costs.observe(1, chosen, GPU_COSTS[chosen.tree])
    assert tried == [variant for variant in LADDER for _ in range(2)]
    assert policy.choose(1, LADDER, high, costs) == LADDER[0]
    # Acceptance falls: plain decoding wins.
    assert CostPolicy().choose(1, LADDER, [_estimate(0.05)], _costs(GPU_COSTS)) == PLAIN


def test_cost_picks_plain_on_a_slow_draft_and_small_trees_in_between():
    """On a CPU-like device where a draft step costs a third of a target step the deep tree
    never pays, and moderate acceptance picks a small tree over plain decoding."""
    cpu_costs = {DEEP: 9.0, LADDER[1].tree: 3.5, LADDER[2].tree: 1.9, None: 1.0}
    assert CostPolicy().choose(1, LADDER, [_estimate(0.1)], _costs(cpu_costs)) == PLAIN
    assert CostPolicy().choose(1, LADDER, [_estimate(0.8)], _costs(cpu_costs)) == LADDER[2]


def test_with_nobody_waiting_cost_speeds_the_slowest_requests():
    """A batch of well-drafted requests and poorly drafted ones: with requests waiting
    (slots refill) the deep tree maximises the batch's tokens per second; with nobody
    waiting the batch lasts as long as its slowest request, for which plain decoding wins
    (unless it is about to end): one poor request among 16 decides."""
    costs = _costs(GPU_COSTS)

    def batch(num_poor, remaining_of_poor, remaining_of_good=100):
        good = [AcceptanceEstimate(alpha=0.9, remaining=remaining_of_good) for _ in range(16)]
        poor = [AcceptanceEstimate(alpha=0.05, remaining=remaining_of_poor)] * num_poor
        return [*good[num_poor:], *poor]

    waiting = [dataclasses.replace(r, remaining=None) for r in batch(5, 100)]
    assert CostPolicy().choose(1, LADDER, waiting, costs) == LADDER[0]
    assert CostPolicy().choose(1, LADDER, batch(5, 100), costs) == PLAIN
    assert CostPolicy().choose(1, LADDER, batch(1, 100), costs) == PLAIN
    assert CostPolicy().choose(1, LADDER, batch(0, 100), costs) == LADDER[0]
    assert CostPolicy().choose(1, LADDER, batch(5, 2), costs) == LADDER[0]
    lone = [AcceptanceEstimate(alpha=0.05, remaining=100)]
    assert CostPolicy().choose(1, LADDER, lone, costs) == PLAIN


def test_a_static_batch_runs_a_tree_that_ends_its_fast_requests_into_a_cheaper_bucket():
    """Three well-drafted requests and one that no tree quite pays for in bucket 4: with
    bucket 4 alone, plain decoding (the slowest request decides); with a bucket 1 whose steps
    cost half as much, a tree, which ends the three well-drafted requests after a few rounds
    and leaves the slowest one to finish in bucket 1."""
    # Every tree at least 0.2 tokens short of paying for the slowest request.
    slow_alpha = min(alpha_for(GPU_COSTS[v.tree] - 1.0 - 0.2, v.tree) for v in LADDER[:-1])
    batch = [AcceptanceEstimate(alpha=0.9, remaining=100) for _ in range(3)]
    batch.append(AcceptanceEstimate(alpha=slow_alpha, remaining=100))
    one_bucket = RoundCosts()
    two_buckets = RoundCosts()
    for variant in LADDER:
        for _ in range(2):  # the first run is not counted
            one_bucket.observe(4, variant, GPU_COSTS[variant.tree])
            two_buckets.observe(4, variant, GPU_COSTS[variant.tree])
            two_buckets.observe(1, variant, GPU_COSTS[variant.tree] / 2)
    assert CostPolicy().choose(4, LADDER, batch, one_bucket) == PLAIN
    assert CostPolicy().choose(4, LADDER, batch, two_buckets) != PLAIN
    # While requests wait, slots refill and the batch never shrinks: the sum decides.
    waiting = [dataclasses.replace(r, remaining=None) for r in batch]
    assert CostPolicy().choose(4, LADDER, waiting, two_buckets) == LADDER[0]


def test_a_static_batch_of_new_requests_is_judged_by_its_kinds_spread():
    """Finished requests of a kind, a quarter of which accepted nothing: one new request
    alone is expected to be a typical one (the tree pays), the slowest of 16 new ones a poor
    one (plain decoding, leaving their drafts behind), until their own speculative rounds
    decide; with requests waiting the spread does not count."""
    book = AcceptanceBook()
    for request in range(16):
        for _ in range(16 * SPREAD_ROUNDS):
            book.observe(request, DEEP, DEEP.depth if request % 4 else 0)
        book.forget(request)
    typical = sorted(book.spread[None])
    assert book.slowest_of(None, 1) == typical[8] and book.slowest_of(None, 16) == typical[0]
    assert typical[0] < 0.2 < 0.5 < typical[8]
    costs = _costs(GPU_COSTS)

    def new_batch(size: int) -> list[AcceptanceEstimate]:
        batch = [book.get(("new", size, i)) for i in range(size)]
        for estimate in batch:
            estimate.remaining, estimate.slowest = 100, book.slowest_of(None, size)
        return batch

    assert CostPolicy().choose(1, LADDER, new_batch(1), costs) == LADDER[0]
    policy = CostPolicy()
    assert policy.choose(1, LADDER, new_batch(16), costs) == PLAIN
    assert policy.leaves_draft_behind(1)  # plain rounds then cost a bare step
    waiting = [dataclasses.replace(e, remaining=None, slowest=None) for e in new_batch(16)]
    assert CostPolicy().choose(1, LADDER, waiting, costs) == LADDER[0]
    measured = new_batch(16)
    for estimate in measured:
        estimate.num_speculative_rounds = SPREAD_ROUNDS
    assert CostPolicy().choose(1, LADDER, measured, costs) == LADDER[0]
    assert AcceptanceBook().slowest_of(None, 4) is None


def test_cost_leaves_drafts_behind_only_when_requests_of_the_kind_would_not_pay():
    """Plain decoding winning for requests at their kind's mean lets the drafts fall
    behind; new requests take the exploring rounds the budget allows first; one request's
    dip below a good mean does not leave its draft behind."""
    costs = _costs(GPU_COSTS)
    policy = CostPolicy()
    poor_kind = AcceptanceEstimate(alpha=0.02, prior=0.02, num_speculative_rounds=1)
    assert policy.choose(1, LADDER, [poor_kind], costs) == PLAIN
    assert policy.leaves_draft_behind(1)
    dip = AcceptanceEstimate(alpha=0.02, prior=0.6, num_speculative_rounds=5)
    assert policy.choose(1, LADDER, [dip], costs) == PLAIN
    assert not policy.leaves_draft_behind(1)
    # A new request every round: the explored ones fit the budget; the rest are left behind.
    policy, chosen, left_behind = CostPolicy(), [], 0
    for _ in range(400):
        chosen.append(policy.choose(1, LADDER, [AcceptanceEstimate(alpha=0.02, prior=0.02)], costs))
        left_behind += policy.leaves_draft_behind(1)
    explored = [c for c in chosen if c != PLAIN]
    assert explored and set(explored) == {LADDER[-2]}
    extra = GPU_COSTS[LADDER[-2].tree] - GPU_COSTS[None]
    assert len(explored) * extra <= EXPLORE_SHARE * left_behind * GPU_COSTS[None] + extra
    assert left_behind == len(chosen) - len(explored)
    # Requests already left behind: no exploring, however long.
    stale = AcceptanceEstimate(alpha=0.6, prior=0.6, in_step=False)
    assert {policy.choose(1, LADDER, [stale], costs) for _ in range(400)} == {PLAIN}


@pytest.mark.parametrize("win", [0.0, IN_STEP_COST / 2, 2 * IN_STEP_COST])
def test_cost_keeps_drafts_in_step_only_for_trees_that_could_repay_it(win):
    """While plain decoding wins on a request's recent rounds, its draft is left behind
    unless, at its kind's mean acceptance, the best tree beats plain decoding by more than
    keeping the draft in step costs (IN_STEP_COST)."""
    prior = 0.45
    seconds = {v.tree: GPU_COSTS[v.tree] for v in LADDER}
    best_rate = max((1 + expected_accepted(prior, t)) / seconds[t] for t in seconds if t)
    seconds[None] = (1 + win) / best_rate
    dip = AcceptanceEstimate(alpha=0.02, prior=prior, num_speculative_rounds=SPREAD_ROUNDS)
    policy = CostPolicy()
    assert policy.choose(1, LADDER, [dip], _costs(seconds)) == PLAIN
    assert policy.leaves_draft_behind(1) == (win < IN_STEP_COST)


def test_cost_runs_plain_whenever_every_draft_is_behind_whatever_the_trees_cost():
    """With every draft behind no tree can be accepted: plain decoding, without weighing the
    shapes, even where a tree round was measured cheaper (noise) or a tree ran last."""
    costs = _costs({DEEP: 0.9, LADDER[1].tree: 0.8, LADDER[2].tree: 0.7, None: 1.0})
    policy = CostPolicy()
    fast = AcceptanceEstimate(alpha=0.9, prior=0.9, num_speculative_rounds=20)
    assert policy.choose(1, LADDER, [fast], costs) != PLAIN
    behind = [dataclasses.replace(fast, in_step=False, remaining=left) for left in (5, 50)]
    assert {policy.choose(1, LADDER, behind, costs) for _ in range(50)} == {PLAIN}


def test_cost_explores_new_requests_of_a_hopeless_kind_less_while_none_pays():
    """New requests of a kind left behind are explored within a budget that shrinks while
    their exploring rounds find none worth a tree, and stays whole while they do; the plain
    rounds of requests whose drafts are behind (the planner marks them out of step) save for
    the next new request only at that shrunken rate."""

    def explored_requests(num_accepted: int) -> int:
        book = AcceptanceBook.with_priors({False: 0.02}, num_observed=10**6)
        policy, costs, num_explored = CostPolicy(), _costs(GPU_COSTS), 0
        for request in range(60):
            for _ in range(100):  # each request: 100 rounds, one at a time
                estimate = book.get(request, kind=False)
                fresh = not estimate.num_speculative_rounds
                chosen = policy.choose(1, LADDER, [estimate], costs)
                book.observe(request, chosen.tree, num_accepted if chosen.tree else 0)
                estimate.in_step = estimate.in_step and not policy.leaves_draft_behind(1)
                num_explored += fresh and chosen.tree is not None
            book.forget(request)
        return num_explored

    never_pays = explored_requests(num_accepted=0)
    always_pays = explored_requests(num_accepted=LADDER[-2].tree.depth)
    assert 1 <= never_pays < always_pays / 3, (never_pays, always_pays)


def test_exploring_rounds_read_after_the_draft_was_left_behind_still_count():
    """On CUDA the host plans a round before it reads the one in flight, so a new request's
    exploring round is read after the next plan has left its draft behind. What it accepted
    still reaches the request's estimate and its kind's running mean, and the exploring
    budget of a kind that never pays shrinks as when each round is read before the next is
    planned."""
    config = EngineConfig(device="cpu", buckets=(1,), policy="cost", trees={1: DEEP})
    params = [SamplingParams()]

    def explored_requests(lag: int) -> tuple[int, float]:
        planner = RoundPlanner(config, has_head=True)
        for variant in planner.candidates(1, params):
            for _ in range(2):  # the first run is not counted
                planner.costs.observe(1, variant.cost_key, GPU_COSTS[variant.tree])
        book = AcceptanceBook.with_priors({True: 0.02}, num_observed=10**6)
        explored, in_flight = set(), deque()
        for request in range(60):
            for round_index in range(100):
                estimate = book.get(request, kind=True)
                in_flight.append(planner.plan(1, params, [estimate]))
                if in_flight[-1].tree is not None:
                    explored.add(request)
                while len(in_flight) > (lag if round_index < 99 else 0):
                    variant = in_flight.popleft()
                    book.observe(request, variant.tree, 0)
                    planner.done(1, variant, GPU_COSTS[variant.tree], [0])
            book.forget(request)
        return len(explored), book.prior(True)

    no_lag, lag = explored_requests(lag=0), explored_requests(lag=1)
    assert lag[1] < 0.02 and lag[1] == pytest.approx(no_lag[1])
    assert 1 <= lag[0] <= no_lag[0] + 2 < 30, (no_lag, lag)


def test_cost_prefills_new_requests_of_a_kind_that_never_pays_without_the_head():
    """New requests of a hopeless kind are prefilled without the head (their drafts out of
    step from the start, so no tree runs for them), but for trials at the rate its explored
    requests paid; a kind whose trials pay keeps being drafted."""
    config = EngineConfig(device="cpu", buckets=(1,), policy="cost", trees={1: DEEP})
    params = [SamplingParams()]

    def drafted_requests(num_accepted: int) -> int:
        planner = RoundPlanner(config, has_head=True)
        for variant in planner.candidates(1, params):
            for _ in range(2):  # the first run is not counted
                planner.costs.observe(1, variant.cost_key, GPU_COSTS[variant.tree])
        book = AcceptanceBook.with_priors({True: 0.02}, num_observed=10**6)
        num_drafted = 0
        for request in range(60):
            estimate = book.get(request, kind=True)
            drafted = planner.drafts_prompts(1, params, [estimate])
            assert estimate.in_step == drafted
            num_drafted += drafted
            for _ in range(100):
                variant = planner.plan(1, params, [estimate])
                assert drafted or variant.tree is None
                accepted = num_accepted if variant.tree is not None else 0
                book.observe(request, variant.tree, accepted)
                planner.done(1, variant, GPU_COSTS[variant.tree], [accepted])
            book.forget(request)
        return num_drafted

    never_pays = drafted_requests(num_accepted=0)
    assert 2 <= never_pays <= 15, never_pays
    assert drafted_requests(num_accepted=LADDER[-2].tree.depth) >= 50


def test_cost_calibrates_a_sampled_tree_that_accepts_less_than_modelled():
    """Sampled trees whose rounds accept a fifth of what the model expects of them (as at
    temperature 1) make plain decoding win for the same estimates; top-k trees keep the
    model's expectation."""
    sampled = [
        RoundVariant(tree=tree) for tree in tree_ladder(dataclasses.replace(DEEP, stochastic=True))
    ]
    costs = _costs(GPU_COSTS)
    for variant, top_k in zip(sampled, LADDER, strict=True):
        for _ in range(2):  # the first run is not counted
            costs.observe(1, variant, GPU_COSTS[top_k.tree])
    requests = [_estimate(0.5) for _ in range(4)]
    for ladder in (sampled, LADDER):
        policy, chosen = CostPolicy(), []
        for _ in range(80):
            chosen.append(policy.choose(1, ladder, requests, costs))
            if chosen[-1].tree is not None:
                expected = requests[0].expected(chosen[-1].tree)
                policy.observe(1, chosen[-1], [expected / 5] * len(requests))
        if ladder is sampled:
            assert policy.calibration[sampled[0].tree] < 0.5
            assert chosen[-16:].count(sampled[-1]) >= 15
        else:
            best = max(LADDER, key=lambda v: (1 + requests[0].expected(v.tree)) / GPU_COSTS[v.tree])
            assert not policy.calibration and set(chosen) == {best} and best != PLAIN


def test_cost_does_not_flap_around_a_threshold():
    """Acceptance wobbling around the point where two shapes tie switches at most once."""
    costs = _costs(GPU_COSTS)
    tie = next(
        a / 1000
        for a in range(1, 1000)
        if (1 + expected_accepted(a / 1000, LADDER[2].tree)) / GPU_COSTS[LADDER[2].tree]
        >= 1 / GPU_COSTS[None]
    )
    policy = CostPolicy()
    chosen = [
        policy.choose(1, LADDER, [_estimate(tie + wobble)], costs) for wobble in [0.01, -0.01] * 20
    ]
    switches = sum(a != b for a, b in itertools.pairwise(chosen))
    assert switches <= 1, [c.tree for c in chosen]


def test_cost_leaves_a_tree_for_plain_decoding_only_by_a_wider_margin():
    """Plain rounds teach the estimates nothing, so a move to plain decoding on a dip stays
    until drift brings the estimates back: a tree gives way to plain decoding only when plain
    wins by PLAIN_HYSTERESIS, wider than the HYSTERESIS between two shapes, and plain decoding
    gives way to a tree at HYSTERESIS. Requests with no speculative rounds of their own (a new
    static batch, holding their kind's mean) leave a tree at HYSTERESIS."""
    costs = _costs(GPU_COSTS)
    deep = LADDER[0]

    def plain_over_best_tree(alpha: float) -> float:
        rates = {v: (1 + expected_accepted(alpha, v.tree)) / GPU_COSTS[v.tree] for v in LADDER}
        return rates[PLAIN] / max(rate for v, rate in rates.items() if v != PLAIN)

    def alpha_at(ratio: float) -> float:
        return min(
            (a / 1000 for a in range(1, 1000)), key=lambda a: abs(plain_over_best_tree(a) - ratio)
        )

    def observed(alpha: float) -> AcceptanceEstimate:
        # A request that has accepted at `alpha` throughout, as its kind does.
        return AcceptanceEstimate(
            alpha=alpha, prior=alpha, num_speculative_rounds=3, typical_length=chain_length(alpha)
        )

    assert HYSTERESIS < PLAIN_HYSTERESIS
    policy = CostPolicy()
    assert policy.choose(1, LADDER, [observed(0.9)], costs) == deep
    between = alpha_at(1 + (HYSTERESIS + PLAIN_HYSTERESIS) / 2)
    assert policy.choose(1, LADDER, [observed(between)], costs) != PLAIN
    assert policy.choose(1, LADDER, [observed(alpha_at(1 + 2 * PLAIN_HYSTERESIS))], costs) == PLAIN
    assert policy.choose(1, LADDER, [observed(between)], costs) == PLAIN
    back = alpha_at(1 / (1 + 2 * HYSTERESIS))
    assert policy.choose(1, LADDER, [observed(back)], costs) != PLAIN
    assert policy.choose(1, LADDER, [observed(between)], costs) != PLAIN
    assert policy.choose(1, LADDER, [_estimate(between), _estimate(between)], costs) == PLAIN


def test_cost_leaves_a_tree_for_plain_decoding_only_if_the_request_as_a_whole_would():
    """A dip in a request's recent rounds takes it to plain decoding only when plain decoding
    also wins at its settled acceptance: its text so far weighed against its kind's mean. A
    request of a kind that pays for the deep tree stays on a tree through a few poor rounds,
    and through a long dip in a text that drafted well; one that drafted poorly throughout
    goes plain."""
    costs = _costs(GPU_COSTS)
    good, poor = 0.8, 0.05

    def request(*, typical: float, num_rounds: int) -> AcceptanceEstimate:
        return AcceptanceEstimate(
            alpha=poor,
            prior=good,
            num_speculative_rounds=num_rounds,
            typical_length=chain_length(typical),
        )

    def after_a_dip(estimate: AcceptanceEstimate) -> RoundVariant:
        policy = CostPolicy()
        start = AcceptanceEstimate(alpha=good, prior=good, num_speculative_rounds=1)
        assert policy.choose(1, LADDER, [start], costs).tree is not None
        return policy.choose(1, LADDER, [estimate], costs)

    assert CostPolicy().choose(1, LADDER, [_estimate(poor)], costs) == PLAIN
    assert after_a_dip(request(typical=poor, num_rounds=3)).tree is not None
    assert after_a_dip(request(typical=good, num_rounds=40)).tree is not None
    assert after_a_dip(request(typical=poor, num_rounds=25 * SETTLED_PRIOR_ROUNDS)) == PLAIN


def test_cost_explores_while_plain_wins():
    """While plain decoding wins the smallest tree still runs now and then, in at most
    EXPLORE_SHARE of the time (plus one round), and every EXPLORE_EVERY rounds while its
    cost is unknown."""
    policy, costs = CostPolicy(), _costs(GPU_COSTS)
    chosen, flagged = [], []
    for _ in range(400):
        chosen.append(policy.choose(1, LADDER, [_estimate(0.02)], costs))
        flagged.append(policy.explored(1))
    explored = [c for c in chosen if c != PLAIN]
    assert explored and all(c == LADDER[-2] for c in explored)
    # The exploring rounds say so (stats count them), the plain ones do not.
    assert flagged == [c != PLAIN for c in chosen]
    extra = GPU_COSTS[LADDER[-2].tree] - GPU_COSTS[None]
    plain_seconds = (len(chosen) - len(explored)) * GPU_COSTS[None]
    assert len(explored) * extra <= EXPLORE_SHARE * plain_seconds + extra
    assert len(explored) * extra >= EXPLORE_SHARE * plain_seconds - extra
    unknown = RoundCosts()
    unknown.seed(1, PLAIN, GPU_COSTS[None])
    policy, poor = make_policy("dsde"), AcceptanceEstimate(divergence=5.0, num_speculative_rounds=1)
    chosen = [policy.choose(1, LADDER, [poor], unknown) for _ in range(4 * EXPLORE_EVERY)]
    assert chosen.count(LADDER[-2]) == 3 and chosen.count(PLAIN) == len(chosen) - 3


def test_batch_table_switches_off_for_good_below_its_cutoff():
    policy = make_policy("batch-table")
    assert policy.choose(1, LADDER, [], RoundCosts()) == LADDER[0]
    for _ in range(300):
        policy.observe(1, LADDER[0], [0])
    assert policy.choose(1, LADDER, [], RoundCosts()) == PLAIN
    for _ in range(300):
        policy.observe(1, LADDER[0], [6])
    assert policy.choose(1, LADDER, [], RoundCosts()) == PLAIN


def test_ema_and_gammatune_follow_accepted_lengths_and_never_pick_plain():
    for name in ("ema", "gammatune"):
        policy = make_policy(name)
        assert policy.choose(1, LADDER, [], RoundCosts()) == LADDER[0]
        for _ in range(40):
            policy.observe(1, LADDER[0], [0, 1, 0])
        low = policy.choose(1, LADDER, [], RoundCosts())
        assert low.tree is not None and low.tree.depth < DEEP.depth, name
        for _ in range(40):
            policy.observe(1, low, [low.tree.depth] * 3)
        assert policy.choose(1, LADDER, [], RoundCosts()) == LADDER[0], name


def test_fixed_runs_the_configured_tree():
    policy = make_policy("fixed")
    assert not policy.adaptive
    assert policy.choose(1, LADDER, [_estimate(0.0)], _costs(GPU_COSTS)) == LADDER[0]


def test_dsde_follows_the_divergence_and_its_stability():
    """Low and steady KL between draft and target: the deepest tree; high KL: plain decoding;
    the same mean KL with a large variance: a shallower tree than steady."""

    def estimate(divergences: list[float]) -> AcceptanceEstimate:
        found = AcceptanceEstimate()
        for kl in divergences:
            found.observe(DEEP, 3, (0.5, kl))
        return found

    steady, wobbly = estimate([0.01] * 30), estimate([0.0, 0.5] * 15)
    assert wobbly.divergence_std > 0.2 > steady.divergence_std
    policy = make_policy("dsde")
    assert policy.choose(1, LADDER, [steady], RoundCosts()) == LADDER[0]
    assert policy.choose(1, LADDER, [estimate([4.0] * 30)], RoundCosts()) == PLAIN
    assert dsde_length(wobbly, 6) < dsde_length(estimate([0.25] * 30), 6)
