"""Speculation policies: before each round, which of the bucket's captured tree shapes (plain
decoding included) the batch runs.

Each bucket has a ladder of candidate shapes (`tree_ladder`): its configured tree, a tree of
half its depth and width, a small tree, and plain decoding. Every candidate is a whole round
compiled (and on CUDA captured) for the bucket, so switching costs nothing; the Decoder keeps
the draft cache in step through plain rounds, so any round may speculate again (until a
policy lets the drafts fall behind for good, `Policy.leaves_draft_behind`).

Policies, by `EngineConfig.policy` name:
- `fixed`: the configured tree, every round (no other shape is built).
- `cost` (the default): the shape that maximises expected tokens per second, the sum over
  live requests of (1 + expected accepted drafts) divided by the round's measured seconds
  (runtime/acceptance.py); a shape not yet measured runs first.
  While no request waits for a slot, nothing refills the slots of requests that end, so the
  batch takes as long as its slowest request: the shape that minimises the time until the
  last request ends. Under a shape, each request ends after remaining tokens / (1 + expected
  accepted drafts) rounds; the batch pays this bucket's cost until few enough are left to
  run in a smaller bucket, then that bucket's (the shape's cost scaled as the plain step's
  is between the buckets). So a tree that the slowest request alone would not pay for still
  runs when it ends the others early enough that the slowest finishes in a cheaper bucket.
  Where a tree costs twice a plain step, overrating the slowest request costs more than
  underrating it: a lower quartile of the requests instead kept trees running at batch 16
  that the slowest request did not pay for. A request that has not yet
  run a few speculative rounds is expected to accept no more than the slowest of a batch
  of its size that its kind's finished requests make likely (`AcceptanceBook.slowest_of`):
  the kind's mean says little about a batch's slowest request.
  The expectation for a sampled (stochastic) tree is calibrated by what that tree's rounds
  accepted against what was expected of them (a moving ratio: the model extrapolates one
  chain acceptance to every tree, and sampled children, drawn with repeats, accept less
  than it predicts for wide levels).
  Hysteresis: the current shape stays unless another beats it by `HYSTERESIS`.
  While plain decoding wins, the smallest tree runs now and then so that acceptance
  estimates stay current: each plain round earns `EXPLORE_SHARE` of its seconds, and an
  exploring round runs when the earnings cover what it costs over a plain round (so
  exploring costs at most that share of the time; every `EXPLORE_EVERY` rounds until both
  rounds are measured).
  When plain decoding wins by `LEAVE_BEHIND_MARGIN` even for requests that accept what
  their kind accepts on average (the engine's running mean, not one request's recent
  rounds, which dip and recover with the text; in a static batch, new requests capped at
  their kind's likely slowest as above), the policy lets the live requests' drafts
  fall behind for good (`leaves_draft_behind`): the planner then runs bare plain steps,
  which neither append to nor commit the pending pairs, so plain decoding costs what it
  costs without a head. Requests that have not yet run a tree take the exploring rounds
  the budget allows first, so the running means keep learning; for a kind left behind,
  that budget shrinks with the share of its explored new requests that turned out worth a
  tree (at their own estimate after the round), so a kind that never pays stops paying for
  exploring too; the plain rounds of requests already left behind save for the next new
  request at that shrunken share as well. New requests of such a kind are prefilled
  without the head, their drafts behind from the start (`drafts_new`), but for one in as
  many as that share says: a trial, run with the head, so the kind can still recover.
- `batch-table`: the configured tree (a batch-size schedule) until the mean accepted drafts
  per request-round over the last `WINDOW` falls below `CUTOFF`, then plain decoding for
  good (TensorRT-LLM's rule; vLLM's table without the cut-off).
- `ema`: a moving average of the batch's accepted drafts picks the shallowest tree at least
  one level deeper (SGLang's rule, over trees instead of chains); never plain.
- `gammatune`: a target depth that grows by one after a round whose rows all accepted every
  level, and otherwise falls halfway to what was accepted; the tree nearest it; never plain.
- `dsde`: each request's speculation length from the KL divergence between draft and target
  the rounds report and its variance (`dsde_length`, DSDE's signal); the tree whose depth is
  nearest the batch's mean length, plain decoding below DSDE_PLAIN_BELOW (exploring as
  `cost` does).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Hashable, Sequence
from typing import ClassVar, Protocol

from .acceptance import AcceptanceEstimate, RoundCosts
from .tree import StaticTree, TreeShape

HYSTERESIS = 0.05
EXPLORE_EVERY, EXPLORE_SHARE = 16, 0.01
CALIBRATION_RATE, CALIBRATION_RANGE = 0.1, (0.2, 1.5)
WINDOW, CUTOFF = 256, 0.5
EMA_RATE = 0.2
DSDE_PLAIN_BELOW = 0.5
LEAVE_BEHIND_MARGIN = 0.1


class Candidate(Protocol, Hashable):
    """A round a bucket can run: its tree (None: plain decoding)."""

    tree: TreeShape | StaticTree | None


def tree_ladder(tree: TreeShape | StaticTree | None) -> tuple[TreeShape | StaticTree | None, ...]:
    """The shapes an adaptive policy chooses among for a bucket configured with `tree`: the
    tree, then, largest first, one of about half its depth and width with a third of its
    nodes and a small (3, 2, 4) tree (both no larger than it), and plain decoding (None)."""
    if tree is None:
        return (None,)
    if isinstance(tree, StaticTree):
        return (tree, None)
    half_depth, half_topk = -(-tree.depth // 2), -(-tree.topk // 2)
    most_nodes = 1 + half_topk + (half_depth - 1) * half_topk**2
    half_nodes = min(max(half_depth + 1, tree.num_nodes // 3), most_nodes)
    half = TreeShape(half_depth, half_topk, half_nodes, tree.stochastic)
    small_depth = min(3, tree.depth)
    small = TreeShape(small_depth, min(2, tree.topk), small_depth + 1, tree.stochastic)
    smaller = sorted({half, small} - {tree}, key=lambda t: (t.num_nodes, t.depth), reverse=True)
    return (tree, *smaller, None)


class Policy:
    """Chooses one of a bucket's candidates before each round (`choose`) and hears every
    round's accepted drafts per live row (`observe`)."""

    name: ClassVar[str]
    # Whether drafts_new may return False.
    skips_drafts: ClassVar[bool] = False

    def choose(
        self,
        bucket: int,
        candidates: Sequence[Candidate],
        requests: Sequence[AcceptanceEstimate],
        costs: RoundCosts,
    ) -> Candidate:
        raise NotImplementedError

    def observe(self, bucket: int, candidate: Candidate, accepted: Sequence[int]) -> None:
        """One round's accepted draft tokens of its live rows."""

    def leaves_draft_behind(self, bucket: int) -> bool:
        """Whether the plain round just chosen for the bucket may leave the live requests'
        drafts behind for good (RoundPlanner.plan then runs a bare plain step)."""
        return False

    def drafts_new(
        self,
        bucket: int,
        candidates: Sequence[Candidate],
        requests: Sequence[AcceptanceEstimate],
        costs: RoundCosts,
    ) -> bool:
        """Whether new requests joining the bucket are prefilled with the head (False:
        their drafts are left behind from the start; RoundPlanner.drafts_prompts)."""
        return True

    @property
    def adaptive(self) -> bool:
        """Whether the policy chooses among several shapes (False: only the first is built)."""
        return True


class FixedPolicy(Policy):
    name = "fixed"

    def choose(self, bucket, candidates, requests, costs):
        return candidates[0]

    @property
    def adaptive(self) -> bool:
        return False


class _ExploringPolicy(Policy):
    """A policy that may pick plain decoding, whose requests' estimates plain rounds do not
    refresh: while plain decoding wins, the smallest tree runs an exploring round whenever
    the plain rounds since the last one have earned its extra cost (`EXPLORE_SHARE`)."""

    def __init__(self) -> None:
        self._current: dict[int, Candidate] = {}
        self._plain_streak: dict[int, int] = {}
        self._explore_credit: dict[int, float] = {}

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
        speculative = _speculative(candidates)
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
            plain = _plain_or_first(candidates)
            share = self._kinds_share(requests)
            chosen = self._settle(bucket, candidates, plain, requests, costs, share=share)
            return self._launched(chosen, requests)
        rates = {c: self._rate(bucket, c, requests, costs) for c in candidates}
        best = max(candidates, key=rates.__getitem__)
        current = self._current.get(bucket)
        if current in rates and rates[best] <= rates[current] * (1 + HYSTERESIS):
            best = current
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

    def _rate(self, bucket, candidate, requests, costs, *, at_prior=False) -> float:
        calibration = self.calibration.get(candidate.tree, 1.0)
        seconds = costs.get(bucket, candidate)
        # Only a static batch shrinks into smaller buckets (while requests wait, slots refill).
        shrinking = _shrinking_costs(bucket, candidate, costs) if _nobody_waits(requests) else []
        return _tokens_per_second(
            candidate, requests, seconds, calibration, at_prior=at_prior, shrinking=shrinking
        )

    def _hopeless(self, bucket, candidates, requests, costs, plain_rate: float) -> bool:
        """Whether plain decoding (at `plain_rate`) beats every tree by LEAVE_BEHIND_MARGIN
        for requests accepting what their kind accepts on average, new ones in a static batch
        no more than its likely slowest (some still in step)."""
        speculative = _speculative(candidates)
        if not speculative or not any(r.in_step for r in requests):
            return False
        rates = [self._rate(bucket, c, requests, costs, at_prior=True) for c in speculative]
        return plain_rate >= (1 + LEAVE_BEHIND_MARGIN) * max(rates)

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
        speculative = _speculative(candidates)
        measured = [r for r in requests if r.num_speculative_rounds]
        if not speculative or not measured:
            return self._ran(bucket, candidates[0])
        deepest = max(c.tree.depth for c in speculative)
        length = sum(dsde_length(r, deepest) for r in measured) / len(measured)
        plain = [c for c in candidates if c.tree is None]
        if length < DSDE_PLAIN_BELOW and plain:
            return self._settle(bucket, candidates, plain[0], requests, costs)
        return self._ran(bucket, _nearest_depth(speculative, length, above=False))


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
    shrinking: Sequence[tuple[int, float]] = (),
) -> float:
    """The batch's expected tokens per second under `candidate` (expected accepted drafts
    times `calibration`; with `at_prior`, of requests accepting what their kind does on
    average); while no request waits (every `remaining` known), the batch's tokens over the
    time it takes to end: the requests end one after another after remaining tokens /
    progress per round rounds (new requests judged by the slowest their kind's spread makes
    likely: AcceptanceEstimate.expected's `as_slowest`), and once few enough are left the
    batch runs in a smaller bucket at `shrinking`'s relative cost (`_shrinking_costs`)."""
    # `slowest` is set only while no request waits, so the cap applies only to that case.
    tree = candidate.tree
    gains = [
        1.0 + calibration * r.expected(tree, at_prior=at_prior, as_slowest=True) for r in requests
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


class BatchTablePolicy(Policy):
    name = "batch-table"

    def __init__(self) -> None:
        self._window: deque[int] = deque(maxlen=WINDOW)
        self.switched_off = False

    def choose(self, bucket, candidates, requests, costs):
        if self.switched_off:
            return _plain_or_first(candidates)
        return candidates[0]

    def observe(self, bucket, candidate, accepted):
        if candidate.tree is None or self.switched_off:
            return
        self._window.extend(accepted)
        full = len(self._window) == self._window.maxlen
        if full and sum(self._window) / len(self._window) < CUTOFF:
            self.switched_off = True


class _DepthPolicy(Policy):
    """A policy that follows a target depth learnt from the accepted lengths of speculative
    rounds: the tree nearest it (`ABOVE`: the shallowest at least that deep); the configured
    tree until it has one; never plain."""

    ABOVE: ClassVar[bool]

    def __init__(self) -> None:
        self._state: float | None = None

    def _target(self, state: float) -> float:
        return state

    def _learn(self, state: float | None, depth: int, accepted: Sequence[int]) -> float:
        """The state after a round of a tree of `depth` whose rows accepted `accepted`."""
        raise NotImplementedError

    def choose(self, bucket, candidates, requests, costs):
        speculative = _speculative(candidates) or list(candidates)
        if self._state is None:
            return speculative[0]
        return _nearest_depth(speculative, self._target(self._state), above=self.ABOVE)

    def observe(self, bucket, candidate, accepted):
        if candidate.tree is None or not accepted:
            return
        self._state = self._learn(self._state, candidate.tree.depth, accepted)


class EmaPolicy(_DepthPolicy):
    """State: a moving average of the accepted drafts; target one level deeper."""

    name = "ema"
    ABOVE = True

    def _target(self, state: float) -> float:
        return math.ceil(state) + 1

    def _learn(self, state, depth, accepted):
        mean = sum(accepted) / len(accepted)
        return mean if state is None else (1 - EMA_RATE) * state + EMA_RATE * mean


class GammaTunePolicy(_DepthPolicy):
    """State: the target depth gamma."""

    name = "gammatune"
    ABOVE = False

    def _learn(self, state, depth, accepted):
        gamma = depth if state is None else state
        if min(accepted) >= depth:
            return gamma + 1
        return max(1.0, (gamma + sum(accepted) / len(accepted)) / 2)


def _speculative(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates that draft a tree."""
    return [c for c in candidates if c.tree is not None]


def _plain_or_first(candidates: Sequence[Candidate]) -> Candidate:
    return next((c for c in candidates if c.tree is None), candidates[0])


def _nearest_depth(candidates: Sequence[Candidate], depth: float, *, above: bool) -> Candidate:
    """The candidate whose depth is nearest `depth`; with `above`, the shallowest at least
    that deep (else the deepest)."""
    if above:
        deep_enough = [c for c in candidates if c.tree.depth >= depth]
        if deep_enough:
            return min(deep_enough, key=lambda c: c.tree.depth)
        return max(candidates, key=lambda c: c.tree.depth)
    return min(candidates, key=lambda c: (abs(c.tree.depth - depth), c.tree.depth))


POLICIES: dict[str, type[Policy]] = {
    policy.name: policy
    for policy in (
        CostPolicy,
        FixedPolicy,
        BatchTablePolicy,
        EmaPolicy,
        GammaTunePolicy,
        DsdePolicy,
    )
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name (config.POLICY_NAMES)."""
    if name not in POLICIES:
        raise ValueError(f"unknown speculation policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
