"""The policies driven by acceptance estimates and measured round costs: `cost` (expected
tokens per second) and `dsde` (speculation length from the draft/target KL signal), with the
exploring rounds that keep estimates current while plain decoding wins (`_ExploringPolicy`).
The rules themselves are stated in the package docstring (runtime/policies/__init__.py)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from ..acceptance import AcceptanceEstimate, RoundCosts
from ..tree import TreeShape
from .base import Candidate, Policy, nearest_depth, plain_or_first, speculative_candidates

HYSTERESIS = 0.05
PLAIN_HYSTERESIS = 0.15
EXPLORE_EVERY, EXPLORE_SHARE = 16, 0.01
CALIBRATION_RATE, CALIBRATION_RANGE = 0.1, (0.2, 1.5)
DSDE_PLAIN_BELOW = 0.5
# What a plain round that keeps the drafts in step costs over a bare plain step (the
# committing round; measured 1.8% at batch 4 on an H200, 3% at batch 16 on an H100). A tree
# expected to win by less than that, at the kind's mean acceptance, cannot repay it.
IN_STEP_COST = 0.02


class _ExploringPolicy(Policy):
    """A policy that may pick plain decoding, whose requests' estimates plain rounds do not
    refresh: while plain decoding wins, the smallest tree runs an exploring round whenever
    the plain rounds since the last one have earned its extra cost (`EXPLORE_SHARE`)."""

    def __init__(self) -> None:
        self._current: dict[int, Candidate] = {}
        self._plain_streak: dict[int, int] = {}
        self._explore_credit: dict[int, float] = {}
        self._explored: dict[int, bool] = {}

    def explored(self, bucket: int) -> bool:
        return self._explored.get(bucket, False)

    def _settle(
        self,
        bucket: int,
        candidates: Sequence[Candidate],
        best: Candidate,
        requests: Sequence[AcceptanceEstimate],
        costs: RoundCosts,
        *,
        share: float = EXPLORE_SHARE,
    ) -> Candidate:
        """Run `best`, or the exploring round when it is due and some request is in step
        (a plain round earns `share` of its seconds; the credit is kept, up to one exploring
        round's, while no request is in step)."""
        speculative = speculative_candidates(candidates)
        if best.tree is not None or not speculative:
            self._explore_credit[bucket] = 0.0
            return self._ran(bucket, best)
        explorer = speculative[-1]
        plain_seconds, explorer_seconds = costs.get(bucket, best), costs.get(bucket, explorer)
        in_step = any(r.in_step for r in requests)
        if plain_seconds is None or explorer_seconds is None:
            due = in_step and self._plain_streak.get(bucket, 0) >= EXPLORE_EVERY
        else:
            extra = explorer_seconds - plain_seconds
            credit = self._explore_credit.get(bucket, 0.0) + share * plain_seconds
            due = in_step and credit >= extra
            self._explore_credit[bucket] = credit - extra if due else min(credit, extra)
        if due:
            return self._ran(bucket, explorer, explored=True)
        return self._ran(bucket, best)

    def _ran(self, bucket: int, candidate: Candidate, *, explored: bool = False) -> Candidate:
        self._explored[bucket] = explored
        if not explored:
            self._current[bucket] = candidate
        plain = candidate.tree is None
        self._plain_streak[bucket] = self._plain_streak.get(bucket, 0) + 1 if plain else 0
        return candidate


class CostPolicy(_ExploringPolicy):
    name = "cost"
    skips_drafts = True

    def __init__(self) -> None:
        super().__init__()
        # Per tree: accepted / expected drafts of its rounds (a moving ratio), and what was
        # expected of its rounds in flight, in launch order.
        self.calibration: dict[Hashable, float] = {}
        self._expected: dict[Hashable, deque[float]] = {}
        self._leave_behind: dict[int, bool] = {}
        # Per kind of request: how many new requests of a hopeless kind were explored, and
        # how many of them turned out worth a tree; the explored ones not yet judged.
        self._trials: dict[Hashable, tuple[int, int]] = {}
        self._on_trial: deque[AcceptanceEstimate] = deque(maxlen=64)
        # Per kind of request: what its new requests of a hopeless kind have earned towards
        # being prefilled with the head (drafts_new).
        self._draft_credit: dict[Hashable, float] = {}

    def choose(self, bucket, candidates, requests, costs):
        self._leave_behind[bucket] = False
        unmeasured = [c for c in candidates if costs.get(bucket, c) is None]
        if unmeasured:
            return self._launched(self._ran(bucket, unmeasured[0]), requests)
        if not any(r.in_step for r in requests):
            # Every draft is behind, so no tree can be accepted and plain decoding wins
            # without weighing the shapes (this runs before every bare plain step). These
            # rounds save for the next new request's exploring round only what its kind's
            # trials have earned.
            plain = plain_or_first(candidates)
            share = self._kinds_share(requests)
            chosen = self._settle(bucket, candidates, plain, requests, costs, share=share)
            return self._launched(chosen, requests)
        rates = {c: self._rate(bucket, c, requests, costs) for c in candidates}
        observed = any(r.num_speculative_rounds for r in requests)
        best = _settled_best(
            rates,
            self._current.get(bucket),
            observed=observed,
            settled_rate=lambda c: self._rate(bucket, c, requests, costs, settled=True),
        )
        share = EXPLORE_SHARE
        if best.tree is None and self._hopeless(bucket, candidates, requests, costs, rates[best]):
            self._judge_trials(bucket, candidates, costs)
            fresh = [r for r in requests if r.in_step and not r.num_speculative_rounds]
            chosen = self._settle(
                bucket, candidates, best, fresh, costs, share=self._kinds_share(requests)
            )
            if chosen.tree is not None:
                self._on_trial.extend(fresh)
            self._leave_behind[bucket] = chosen.tree is None
            return self._launched(chosen, requests)
        chosen = self._settle(bucket, candidates, best, requests, costs, share=share)
        return self._launched(chosen, requests)

    def leaves_draft_behind(self, bucket):
        return self._leave_behind.get(bucket, False)

    def drafts_new(self, bucket, candidates, requests, costs):
        """True unless plain decoding would leave the new requests' drafts behind from the
        start (`_hopeless` at their kinds' means) and none of them is due a trial: each new
        request of a hopeless kind earns its kind the rate at which its explored requests
        paid (`_trial_share` / EXPLORE_SHARE, 1 before any was judged), and the requests
        are drafted when one's kind has earned 1, so a kind whose trials never pay runs
        the head over ever fewer prompts."""
        plain = [c for c in candidates if c.tree is None]
        if not plain or any(costs.get(bucket, c) is None for c in candidates):
            return True
        plain_rate = self._rate(bucket, plain[0], requests, costs)
        if not self._hopeless(bucket, candidates, requests, costs, plain_rate):
            return True
        due = False
        for request in requests:
            earned = self._draft_credit.get(request.kind, 0.0)
            earned += self._trial_share(request.kind) / EXPLORE_SHARE
            if earned >= 1.0:
                earned, due = earned - 1.0, True
            self._draft_credit[request.kind] = earned
        return due

    def _rate(self, bucket, candidate, requests, costs, *, at_prior=False, settled=False) -> float:
        calibration = self.calibration.get(candidate.tree, 1.0)
        seconds = costs.get(bucket, candidate)
        # Only a static batch shrinks into smaller buckets (while requests wait, slots refill).
        shrinking = _shrinking_costs(bucket, candidate, costs) if _nobody_waits(requests) else []
        return _tokens_per_second(
            candidate,
            requests,
            seconds,
            calibration,
            at_prior=at_prior,
            settled=settled,
            shrinking=shrinking,
        )

    def _hopeless(self, bucket, candidates, requests, costs, plain_rate: float) -> bool:
        """Whether no tree beats plain decoding (at `plain_rate`) by IN_STEP_COST for
        requests accepting what their kind accepts on average, new ones in a static batch
        no more than its likely slowest (some still in step): then keeping the drafts in step
        costs more than speculating could win back."""
        speculative = speculative_candidates(candidates)
        if not speculative or not any(r.in_step for r in requests):
            return False
        rates = [self._rate(bucket, c, requests, costs, at_prior=True) for c in speculative]
        return (1 + IN_STEP_COST) * plain_rate >= max(rates)

    def _kinds_share(self, requests: Sequence[AcceptanceEstimate]) -> float:
        """The exploring share the requests' kinds have earned (the most of theirs)."""
        return max((self._trial_share(r.kind) for r in requests), default=EXPLORE_SHARE)

    def _trial_share(self, kind: Hashable) -> float:
        """The exploring share for new requests of a hopeless `kind`: EXPLORE_SHARE times
        the rate at which exploring its new requests found one worth a tree (counting one
        success before any trial)."""
        num_explored, num_paid = self._trials.get(kind, (0, 0))
        return EXPLORE_SHARE * (num_paid + 1) / (num_explored + 1)

    def _judge_trials(self, bucket, candidates, costs) -> None:
        """Count each explored new request whose round has been observed: it paid when some
        tree beats plain decoding for it alone, at its own estimate."""
        waiting = []
        for estimate in self._on_trial:
            if not estimate.num_speculative_rounds:
                waiting.append(estimate)
                continue
            rates = {c.tree: self._rate(bucket, c, [estimate], costs) for c in candidates}
            paid = max(rates.values()) > rates[None]
            num_explored, num_paid = self._trials.get(estimate.kind, (0, 0))
            self._trials[estimate.kind] = (num_explored + 1, num_paid + paid)
        self._on_trial.clear()
        self._on_trial.extend(waiting)

    def _launched(self, chosen: Candidate, requests: Sequence[AcceptanceEstimate]) -> Candidate:
        """Remember what `chosen` is expected to accept, for `observe` to calibrate by."""
        if isinstance(chosen.tree, TreeShape) and chosen.tree.stochastic:
            expected = sum(r.expected(chosen.tree) for r in requests)
            self._expected.setdefault(chosen.tree, deque(maxlen=16)).append(expected)
        return chosen

    def observe(self, bucket, candidate, accepted):
        in_flight = self._expected.get(candidate.tree)
        if candidate.tree is None or not in_flight:
            return
        expected = in_flight.popleft()
        if expected <= 0 or not accepted:
            return
        low, high = CALIBRATION_RANGE
        ratio = min(max(sum(accepted) / expected, low), high)
        old = self.calibration.get(candidate.tree, ratio)
        self.calibration[candidate.tree] = old + CALIBRATION_RATE * (ratio - old)


class DsdePolicy(_ExploringPolicy):
    name = "dsde"

    def choose(self, bucket, candidates, requests, costs):
        speculative = speculative_candidates(candidates)
        measured = [r for r in requests if r.num_speculative_rounds]
        if not speculative or not measured:
            return self._ran(bucket, candidates[0])
        deepest = max(c.tree.depth for c in speculative)
        length = sum(dsde_length(r, deepest) for r in measured) / len(measured)
        plain = [c for c in candidates if c.tree is None]
        if length < DSDE_PLAIN_BELOW and plain:
            return self._settle(bucket, candidates, plain[0], requests, costs)
        return self._ran(bucket, nearest_depth(speculative, length, above=False))


def _settled_best(
    rates: dict[Candidate, float],
    current: Candidate | None,
    *,
    observed: bool,
    settled_rate: Callable[[Candidate], float],
) -> Candidate:
    """The candidate of the highest rate, with hysteresis: any shape must beat the current
    one by HYSTERESIS, and from a tree, while some request's estimate rests on speculative
    rounds of its own (`observed`), plain decoding must beat the best tree by
    PLAIN_HYSTERESIS and also win at the requests' settled acceptance (`settled_rate`, a
    tree's rate for the batch at AcceptanceEstimate.settled_alpha): plain rounds teach the estimates
    nothing, so a move to plain decoding on a dip in them lasts until they drift back, and
    a request whose text as a whole pays for a tree loses those rounds. Requests with none
    (a new static batch) hold only their kind's running mean, which does not dip."""
    best = max(rates, key=rates.__getitem__)
    trees = [c for c in rates if c.tree is not None]
    tree_now = current is not None and current.tree is not None
    if observed and best.tree is None and tree_now and trees:
        best_tree = max(trees, key=rates.__getitem__)
        dip = rates[best] <= rates[best_tree] * (1 + PLAIN_HYSTERESIS)
        # Plain decoding expects no drafts, so its rate is the same at any acceptance.
        if dip or rates[best] <= max(map(settled_rate, trees)):
            best = best_tree
    if current in rates and rates[best] <= rates[current] * (1 + HYSTERESIS):
        best = current
    return best


def dsde_length(estimate: AcceptanceEstimate, max_depth: int) -> float:
    """A request's speculation length from its KL signal: a level is accepted with about
    1 - sqrt(KL / 2) (Pinsker's bound on the total variation distance, whose complement is
    the acceptance of one sampled draft), lowered by the KL's instability (divided by 1 + its
    standard deviation); the expected run of such a chain, capped at `max_depth`."""
    level = max(0.0, 1.0 - math.sqrt(estimate.divergence / 2)) / (1.0 + estimate.divergence_std)
    if level >= 1.0:
        return float(max_depth)
    return min(float(max_depth), level / (1.0 - level))


def _tokens_per_second(
    candidate: Candidate,
    requests: Sequence[AcceptanceEstimate],
    seconds: float,
    calibration: float = 1.0,
    *,
    at_prior: bool = False,
    settled: bool = False,
    shrinking: Sequence[tuple[int, float]] = (),
) -> float:
    """The batch's expected tokens per second under `candidate` (expected accepted drafts
    times `calibration`; with `at_prior`, of requests accepting what their kind does on
    average; with `settled`, at their settled acceptance); while no request waits (every
    `remaining` known), the batch's tokens over the time it takes to end: the requests end
    one after another after remaining tokens / progress per round rounds (new requests
    judged by the slowest their kind's spread makes likely: AcceptanceEstimate.expected's
    `as_slowest`), and once few enough are left the batch runs in a smaller bucket at
    `shrinking`'s relative cost (`_shrinking_costs`)."""
    # `slowest` is set only while no request waits, so the cap applies only to that case.
    tree = candidate.tree
    gains = [
        1.0 + calibration * r.expected(tree, at_prior=at_prior, settled=settled, as_slowest=True)
        for r in requests
    ]
    if not _nobody_waits(requests):
        return sum(gains) / seconds
    total = sum(max(r.remaining, 1) for r in requests)
    ends = sorted(max(r.remaining, 1) / g for g, r in zip(gains, requests, strict=True))
    scales = _scales_by_live(len(ends), shrinking)
    elapsed = done = 0.0
    for num_ended, end in enumerate(ends):
        elapsed += (end - done) * scales[len(ends) - num_ended - 1]
        done = end
    return total / (elapsed * seconds)


def _scales_by_live(num_requests: int, shrinking: Sequence[tuple[int, float]]) -> list[float]:
    """For 1..num_requests live requests, the relative cost of a round in the smallest of
    `shrinking`'s buckets (smallest first) that holds them, 1.0 where none does."""
    scales = []
    index = 0
    for num_live in range(1, num_requests + 1):
        while index < len(shrinking) and shrinking[index][0] < num_live:
            index += 1
        scales.append(shrinking[index][1] if index < len(shrinking) else 1.0)
    return scales


def _nobody_waits(requests: Sequence[AcceptanceEstimate]) -> bool:
    """Whether the batch is static: every request's `remaining` is known (the scheduler
    sets it only while no request waits for a slot)."""
    return bool(requests) and all(r.remaining is not None for r in requests)


def _shrinking_costs(
    bucket: int, candidate: Candidate, costs: RoundCosts
) -> list[tuple[int, float]]:
    """For each smaller bucket whose plain step was measured, smallest first: (the bucket, its
    plain step's seconds over this bucket's), what a round costs there relative to here once
    requests that end let the batch move into it (a tree round costs about the same multiple
    of a plain step in every bucket)."""
    plain = dataclasses.replace(candidate, tree=None)
    here = costs.get(bucket, plain)
    if here is None:
        return []
    found = []
    for smaller in costs.buckets():
        seconds = costs.get(smaller, plain) if smaller < bucket else None
        if seconds is not None:
            found.append((smaller, seconds / here))
    return found
