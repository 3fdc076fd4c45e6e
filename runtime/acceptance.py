"""What the adaptive speculation policies decide from: each request's acceptance estimate and
each round's measured cost.

Acceptance model. A request's draft is summarised by its chain acceptance alpha: the chance
that a level of a one-wide chain is accepted, given the levels above it were. A tree level
offers about w = min(K, (N - 1) / D) candidates, and is accepted when one of them is. Were
they independent tries, its acceptance would be 1 - (1 - alpha)^w; but the draft ranks its
candidates, and the target's token is mostly its first or none near the top, so each one
past the first adds far less. The model counts the level as w^WIDTH_EXPONENT independent
tries, a = 1 - (1 - alpha)^(w^WIDTH_EXPONENT), and the accepted length of a depth-D tree is
sum_{d=1..D} a^d (levels accepted one after another, as the walk goes). WIDTH_EXPONENT (and
SAMPLED_WIDTH_EXPONENT for the candidates a stochastic tree samples) were fitted to what the
same requests accepted under four shapes (BENCHMARKS.md, "One request's acceptance carried
across tree shapes"): with independent tries (exponent 1) a request's acceptance measured
under (6, 8, 40) predicted 31% too little under (4, 6, 16) and 50% too little under (2, 3, 5).
Every blend of estimates that is not a round's observation (the drifts below, a request's
typical value, the running means of its kind) is taken in the accepted length of a one-wide
chain of CHAIN_DEPTH levels (`chain_length`), a scale the width term does not touch, so that
how far an estimate moves does not depend on how widths are counted. Every speculative
round moves the accepted length expected of the shape it ran a step (`ALPHA_RATE`) towards
what the request accepted, and maps that back to alpha (`alpha_for`): the estimate follows
the accepted length itself. (Averaging per-round level rates mapped through the width is
biased: accepted lengths are far from geometric, most rounds stopping at the root or running
the whole depth, and the mapping is not linear; with the shipped head it under-predicted
established requests by 13-19%.) Plain rounds say nothing about it, so each one
moves it a small step back towards the running mean of the engine's requests of its kind
(`STALE_RATE`; greedy and sampling requests keep separate means, as they accept very
differently; a kind's mean learns from rounds until SPREAD_MIN of its requests have
finished, then from finished requests, each weighted alike): a request that fell back to
plain decoding after a few poor rounds is tried again, after a hundred plain rounds or so,
unless such requests accept little in general
(acceptance moves with the text; a stale low estimate would keep the request plain for
good). The step is small because the exploring rounds (runtime/policies/) measure such a
request again anyway, and a faster drift made a static batch retry trees on its slowest
request every few rounds. A request that has run SPREAD_ROUNDS speculative rounds also
moves a larger step (`RECOVERY_RATE`) towards its own typical alpha, the mean of its
estimates over those rounds (in chain length): two or three rejected rounds in a text it
drafts well are a dip, and with a strong head they otherwise kept it plain for dozens of
rounds it would have gained in; a request that drafts poorly throughout has a low typical
alpha and stays plain. Once a plain round has left a request's draft behind for good
(`in_step` False: see RoundPlanner.plan) no tree is expected to accept anything for it. A
speculative round also reports, at the root, the draft's confidence and the KL divergence
of its distribution from the target's (round.acceptance_signals); each request keeps their
moving averages and the KL's variance (DSDE's stability signal).

A draft head may ship what it accepted when it was measured (`MeasuredAcceptance`, the
`accepted` entry of its trees.json): the engine's running means then start from it, weighted
like `MEASURED_ROUNDS` rounds, instead of from PRIOR_ALPHA, so a kind of request the head
drafts poorly for (sampling at temperature 1, say) is known to be from the first round.

Costs are seconds per round, per (bucket, round variant): a moving average of the rounds the
host has read (GPU time on CUDA), seeded from a measured profile when there is one.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from .tree import StaticTree, TreeShape

# The chain acceptance assumed for a request before any of its rounds speculated, while the
# engine has seen none either.
PRIOR_ALPHA = 0.6
# Weight of one speculative round in a request's running accepted length (and so its alpha).
# On CUDA the host plans each round before reading the last one's report, so a round's
# surprise steers the round after next; a faster rate chases dips that are over by then.
ALPHA_RATE = 0.15
# How many rounds a head's measured acceptance counts as in the running mean of its kind.
MEASURED_ROUNDS = 16
# Weight of one speculative round in the running mean alpha of its kind of request, once the
# mean has seen enough rounds (before: 1 / (rounds seen + 2), the prior one of them), until
# SPREAD_MIN requests of the kind have finished.
PRIOR_RATE = 0.05
# From then on, the weight of one finished request's typical value in its kind's mean.
PRIOR_REQUEST_RATE = 0.1
# The step back towards the engine's running mean alpha of a request's alpha per plain round.
STALE_RATE = 0.01
# The step back towards its own typical alpha per plain round, once it has run SPREAD_ROUNDS
# speculative rounds.
RECOVERY_RATE = 0.1
# Weight of one round in a round cost's moving average.
COST_RATE = 0.2
# Speculative rounds after which a request's own estimate decides for it in a static batch,
# and a finished request joins its kind's spread (AcceptanceBook.slowest_of); how many
# finished requests a kind keeps, and how many it needs before its spread is used.
SPREAD_ROUNDS = 4
SPREAD_KEPT, SPREAD_MIN = 256, 8
# How many rounds of its kind's running mean a request's settled acceptance starts from
# (AcceptanceEstimate.settled_alpha).
SETTLED_PRIOR_ROUNDS = 8
# The chain whose accepted length the estimator's blends are taken in (module docstring).
CHAIN_DEPTH = 8
# The power of a level's width that counts as independent tries (module docstring): for the
# top-k candidates of a greedy round, and for the candidates a stochastic tree samples.
WIDTH_EXPONENT = 0.25
SAMPLED_WIDTH_EXPONENT = 0.15


@functools.cache
def level_width(tree: TreeShape | StaticTree) -> float:
    """Candidates a level of the tree offers the walk, on average (at least 1)."""
    per_level = (tree.num_nodes - 1) / tree.depth
    if isinstance(tree, TreeShape):
        per_level = min(tree.topk, per_level)
    return max(1.0, per_level)


@functools.cache
def effective_width(tree: TreeShape | StaticTree) -> float:
    """How many independent tries a level of the tree counts as (module docstring)."""
    sampled = getattr(tree, "stochastic", False)
    return level_width(tree) ** (SAMPLED_WIDTH_EXPONENT if sampled else WIDTH_EXPONENT)


def expected_accepted(alpha: float, tree: TreeShape | StaticTree | None) -> float:
    """Expected accepted draft tokens per round of a request with chain acceptance `alpha`
    (module docstring); 0 for plain decoding."""
    if tree is None:
        return 0.0
    level = 1.0 - (1.0 - alpha) ** effective_width(tree)
    if level >= 1.0:
        return float(tree.depth)
    return level * (1.0 - level**tree.depth) / (1.0 - level)


def alpha_for(accepted: float, tree: TreeShape | StaticTree) -> float:
    """The chain acceptance whose expected accepted drafts per round of `tree` is `accepted`
    (clamped to what the tree can accept)."""
    return chain_acceptance(_level_for(accepted, tree.depth), effective_width(tree))


def _level_for(accepted: float, depth: int) -> float:
    """The level acceptance a in [0, 1] with sum_{d=1..depth} a^d = `accepted` (clamped to
    [0, depth]), by Newton's method on that increasing, convex polynomial: started above the
    root (at the first level of a fixed grid whose sum exceeds `accepted`), every step stays
    above it, so two or three steps converge. It runs for every request after every round."""
    if accepted <= 0.0:
        return 0.0
    if accepted >= depth:
        return 1.0
    level = bisect.bisect_right(_grid_sums(depth), accepted) / _GRID_STEPS
    for _ in range(64):
        # Horner: q = sum_{d<depth} a^d and its derivative; the sum is a * q.
        q, dq = 0.0, 0.0
        for _ in range(depth):
            dq = dq * level + q
            q = q * level + 1.0
        step = (level * q - accepted) / (q + level * dq)
        level -= step
        if step < 1e-12:
            break
    return min(max(level, 0.0), 1.0)


_GRID_STEPS = 256


@functools.cache
def _grid_sums(depth: int) -> tuple[float, ...]:
    """sum_{d=1..depth} a^d at a = i / _GRID_STEPS, i = 0.._GRID_STEPS (increasing)."""
    return tuple(
        sum((i / _GRID_STEPS) ** d for d in range(1, depth + 1)) for i in range(_GRID_STEPS + 1)
    )


def chain_acceptance(level: float, width: float) -> float:
    """Inverse of the level acceptance: the alpha that gives a level of `width` independent
    tries acceptance `level`."""
    return 1.0 - (1.0 - level) ** (1.0 / width)


def chain_length(alpha: float) -> float:
    """Expected accepted drafts of a one-wide chain of CHAIN_DEPTH levels: the scale the
    estimator blends in (module docstring)."""
    length = 0.0
    for _ in range(CHAIN_DEPTH):
        length = (length + 1.0) * alpha
    return length


def alpha_of_chain(length: float) -> float:
    """Inverse of `chain_length`."""
    return _level_for(length, CHAIN_DEPTH)


@dataclass(frozen=True)
class MeasuredAcceptance:
    """What a draft head accepted with one tree when it was measured: tokens per round
    (accepted drafts + 1) of greedy requests (the tree's top-k form) and of sampling ones
    (its stochastic form), either None when not measured."""

    tree: TreeShape
    greedy: float | None = None
    sampling: float | None = None

    def __post_init__(self) -> None:
        for name in ("greedy", "sampling"):
            value = getattr(self, name)
            if value is not None and not 1.0 <= value <= self.tree.depth + 1:
                raise ValueError(
                    f"{name} must be tokens per round of the tree {self.tree}, between 1 and "
                    f"{self.tree.depth + 1}, got {value}"
                )

    def priors(self) -> dict[bool, float]:
        """The chain acceptance alpha by kind of request (True: greedy) that reproduces what
        was measured with the tree's form that kind runs."""
        measured = {True: self.greedy, False: self.sampling}
        return {
            kind: alpha_for(v - 1.0, replace(self.tree, stochastic=not kind))
            for kind, v in measured.items()
            if v
        }


@dataclass
class AcceptanceEstimate:
    """One request's acceptance: its chain acceptance `alpha`, and the history the simpler
    policies read (the last round's accepted tokens and depth).

    alpha: starts at the running mean of the engine's requests of its kind
        (`AcceptanceBook.prior`).
    kind: what the engine's running means are kept by (AcceptanceBook.get).
    prior: the running mean alpha of the engine's requests of its kind, as of the last
        AcceptanceBook.get.
    in_step: whether the request's draft cache is in step with its tokens (False once a
        plain round left it behind: its drafts cannot be accepted but by chance).
    num_in_step_in_flight: rounds launched while the draft was in step whose reports have
        not been read (RoundPlanner.plan counts them, AcceptanceBook.observe reads them):
        they count even when read after the draft was left behind.
    remaining: the tokens the request may still generate, set by the scheduler before each
        round while no request waits for a slot (the batch then runs until its longest
        request ends); None while some do.
    slowest: while no request waits, the alpha of the slowest of the batch's requests as its
        kind's finished requests spread (AcceptanceBook.slowest_of); None while some wait or
        the kind has not finished enough requests.
    typical_length: the mean of chain_length(alpha) over the request's speculative rounds
        (what it accepts over its whole text; `typical_alpha` in alpha, for its kind's
        spread).
    """

    alpha: float = PRIOR_ALPHA
    kind: Hashable = None
    prior: float = PRIOR_ALPHA
    in_step: bool = True
    num_in_step_in_flight: int = 0
    confidence: float = 0.0
    divergence: float = 0.0
    divergence_square: float = 0.0
    num_rounds: int = 0
    num_speculative_rounds: int = 0
    rounds_since_speculation: int = 0
    last_accepted: int = 0
    last_depth: int = 0
    remaining: int | None = None
    slowest: float | None = None
    typical_length: float = 0.0

    def observe(
        self,
        tree: TreeShape | StaticTree | None,
        num_accepted: int,
        signals: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """Record one round that ran `tree` (None: plain) and accepted `num_accepted` drafts,
        with its (confidence, divergence) signals."""
        self.num_rounds += 1
        if tree is None:
            self.rounds_since_speculation += 1
            return
        self.rounds_since_speculation = 0
        self.num_speculative_rounds += 1
        self.last_accepted, self.last_depth = num_accepted, tree.depth
        rate = 1.0 if self.num_speculative_rounds == 1 else ALPHA_RATE
        confidence, divergence = signals
        self.confidence = _blend(self.confidence, confidence, rate)
        self.divergence = _blend(self.divergence, divergence, rate)
        self.divergence_square = _blend(self.divergence_square, divergence**2, rate)
        expected = expected_accepted(self.alpha, tree)
        self.alpha = alpha_for(_blend(expected, num_accepted, ALPHA_RATE), tree)
        self.typical_length += (
            chain_length(self.alpha) - self.typical_length
        ) / self.num_speculative_rounds

    @property
    def typical_alpha(self) -> float:
        """The alpha of the request's typical accepted length (`typical_length`)."""
        return alpha_of_chain(self.typical_length)

    @property
    def settled_alpha(self) -> float:
        """The request's acceptance over its whole text so far (`typical_alpha`) weighed
        against its kind's running mean as if that were SETTLED_PRIOR_ROUNDS rounds of it:
        what the request accepts in the long run, which a few poor rounds barely move. In
        alpha, not chain length: a long chain's length is so convex in alpha that a kind
        drafting well would outweigh dozens of a request's own poor rounds."""
        num_rounds = self.num_speculative_rounds
        weighted = self.prior * SETTLED_PRIOR_ROUNDS + self.typical_alpha * num_rounds
        return weighted / (SETTLED_PRIOR_ROUNDS + num_rounds)

    @property
    def divergence_std(self) -> float:
        """The standard deviation of the root KL divergence over recent rounds."""
        return math.sqrt(max(self.divergence_square - self.divergence**2, 0.0))

    def expected(
        self,
        tree: TreeShape | StaticTree | None,
        *,
        at_prior: bool = False,
        settled: bool = False,
        as_slowest: bool = False,
    ) -> float:
        """Expected accepted draft tokens of one round of `tree` (0 for plain, and once the
        draft was left behind); with `at_prior`, for a request of its kind on average; with
        `settled`, at the request's `settled_alpha`; with
        `as_slowest`, no more than `slowest` accepts until the request has run
        SPREAD_ROUNDS speculative rounds (so a static batch of new requests is judged by the
        slowest its kind's spread makes likely, not by the mean)."""
        if not self.in_step:
            return 0.0
        alpha = self.prior if at_prior else self.settled_alpha if settled else self.alpha
        new = self.num_speculative_rounds < SPREAD_ROUNDS
        if as_slowest and new and self.slowest is not None:
            alpha = min(alpha, self.slowest)
        return expected_accepted(alpha, tree)


@dataclass
class AcceptanceBook:
    """The estimates of the requests decoding, and per kind of request (greedy or sampling,
    say) the running mean that new requests of that kind start from and the typical alphas
    of its last finished requests (`spread`).

    prior_lengths: each kind's running mean, kept as the chain length (`chain_length`) it is
        blended in, so a round's observations cost no inversion; `prior` inverts it once per
        change.
    """

    prior_lengths: dict[Hashable, float] = field(default_factory=dict)
    estimates: dict[Hashable, AcceptanceEstimate] = field(default_factory=dict)
    num_observed: dict[Hashable, int] = field(default_factory=dict)
    spread: dict[Hashable, deque[float]] = field(default_factory=dict)
    # Each kind's running mean alpha, kept until its length changes (`prior` is asked for
    # every live request before every round).
    _prior_alphas: dict[Hashable, float] = field(default_factory=dict, repr=False)
    # Each kind's spread sorted, kept until the kind's next finished request (slowest_of is
    # asked for every live request before every round).
    _sorted_spread: dict[Hashable, list[float]] = field(default_factory=dict, repr=False)

    @classmethod
    def starting_from(cls, measured: MeasuredAcceptance | None) -> AcceptanceBook:
        """A book whose running means start at what a head was measured to accept (counted
        as MEASURED_ROUNDS rounds of each kind); an empty one for None."""
        if measured is None:
            return cls()
        return cls.with_priors(measured.priors(), num_observed=MEASURED_ROUNDS)

    @classmethod
    def with_priors(cls, priors: dict[Hashable, float], *, num_observed: int) -> AcceptanceBook:
        """A book whose running mean alphas start at `priors` (kind -> alpha), each counted
        as `num_observed` rounds."""
        return cls(
            prior_lengths={kind: chain_length(alpha) for kind, alpha in priors.items()},
            num_observed=dict.fromkeys(priors, num_observed),
        )

    @property
    def priors(self) -> dict[Hashable, float]:
        """The running mean alpha of each kind of request observed (or measured)."""
        return {kind: self.prior(kind) for kind in self.prior_lengths}

    def prior(self, kind: Hashable = None) -> float:
        """The running mean alpha of the requests of `kind` (PRIOR_ALPHA before any)."""
        alpha = self._prior_alphas.get(kind)
        if alpha is None:
            length = self.prior_lengths.get(kind)
            alpha = PRIOR_ALPHA if length is None else alpha_of_chain(length)
            self._prior_alphas[kind] = alpha
        return alpha

    def _prior_length(self, kind: Hashable) -> float:
        length = self.prior_lengths.get(kind)
        return chain_length(PRIOR_ALPHA) if length is None else length

    def get(self, request: Hashable, kind: Hashable = None) -> AcceptanceEstimate:
        """The request's estimate (a new one starts at the prior of its `kind`)."""
        if request not in self.estimates:
            self.estimates[request] = AcceptanceEstimate(alpha=self.prior(kind), kind=kind)
        estimate = self.estimates[request]
        estimate.prior = self.prior(estimate.kind)
        return estimate

    def observe(
        self,
        request: Hashable,
        tree: TreeShape | StaticTree | None,
        num_accepted: int,
        signals: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        # Not `get`: the estimate's `prior` is refreshed where plans read it, not per report.
        estimate = self.estimates.get(request) or self.get(request)
        launched_in_step = estimate.in_step or estimate.num_in_step_in_flight > 0
        estimate.num_in_step_in_flight = max(estimate.num_in_step_in_flight - 1, 0)
        if not launched_in_step:
            return
        estimate.observe(tree, num_accepted, signals)
        kind = estimate.kind
        if tree is None:
            length = _blend(chain_length(estimate.alpha), self._prior_length(kind), STALE_RATE)
            if estimate.num_speculative_rounds >= SPREAD_ROUNDS:
                length = _blend(length, estimate.typical_length, RECOVERY_RATE)
            estimate.alpha = alpha_of_chain(length)
        elif len(self.spread.get(kind, ())) < SPREAD_MIN:
            seen = self.num_observed.get(kind, 0)
            self.num_observed[kind] = seen + 1
            rate = max(PRIOR_RATE, 1.0 / (seen + 2))
            self._move_prior(kind, chain_length(estimate.alpha), rate)

    def _move_prior(self, kind: Hashable, length: float, rate: float) -> None:
        self.prior_lengths[kind] = _blend(self._prior_length(kind), length, rate)
        self._prior_alphas.pop(kind, None)

    def forget(self, request: Hashable) -> None:
        """Drop a finished request's estimate; one that ran SPREAD_ROUNDS speculative rounds
        joins its kind's spread, and once SPREAD_MIN have, moves its kind's running mean
        PRIOR_REQUEST_RATE towards its typical value (the mean then weighs requests, not
        rounds: at batch 1 a mean of rounds is the last request's)."""
        estimate = self.estimates.pop(request, None)
        if estimate is not None and estimate.num_speculative_rounds >= SPREAD_ROUNDS:
            kept = self.spread.setdefault(estimate.kind, deque(maxlen=SPREAD_KEPT))
            kept.append(estimate.typical_alpha)
            self._sorted_spread.pop(estimate.kind, None)
            if len(kept) >= SPREAD_MIN:
                self._move_prior(estimate.kind, estimate.typical_length, PRIOR_REQUEST_RATE)

    def slowest_of(self, kind: Hashable, num_requests: int) -> float | None:
        """The alpha the slowest of `num_requests` new requests of `kind` is likely to have:
        the 1 / (num_requests + 1) quantile of the kind's spread (None below SPREAD_MIN
        finished requests)."""
        found = self._sorted_spread.get(kind)
        if found is None:
            found = self._sorted_spread[kind] = sorted(self.spread.get(kind, ()))
        if len(found) < SPREAD_MIN:
            return None
        return found[int(len(found) / (num_requests + 1))]


class RoundCosts:
    """Seconds per round by (bucket, variant key): a moving average of measured rounds, from
    a profile's value when one was loaded (`seed`). A round's first run is not counted (it may
    pay one-time costs: lazy initialisation, allocator growth, a first compile). A `frozen`
    table keeps what was seeded and ignores the rounds it is told about (a profile of another
    device replayed here: `specrun eval --cost-profile`)."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, Hashable], float] = {}
        self._num_seen: dict[tuple[int, Hashable], int] = {}
        self.frozen = False

    def get(self, bucket: int, key: Hashable) -> float | None:
        """The round's cost in seconds, or None until it has run twice (or a profile gave
        it)."""
        return self._seconds.get((bucket, key))

    def buckets(self) -> list[int]:
        """The buckets some round's cost is known in, smallest first."""
        return sorted({bucket for bucket, _ in self._seconds})

    def milliseconds(self) -> dict[str, float]:
        """Every known cost in milliseconds by "bucket:tag" (the key's `tag`, as
        EngineStats.rounds_by_bucket names rounds), smallest bucket first."""
        ordered = sorted(self._seconds.items(), key=lambda item: item[0][0])
        return {f"{bucket}:{key.tag}": 1e3 * seconds for (bucket, key), seconds in ordered}

    def seed(self, bucket: int, key: Hashable, seconds: float) -> None:
        """Start the round's average at a measured value (runtime/cost_profile.py)."""
        self._seconds[(bucket, key)] = seconds
        self._num_seen[(bucket, key)] = max(self._num_seen.get((bucket, key), 0), 1)

    def observe(self, bucket: int, key: Hashable, seconds: float) -> None:
        if self.frozen or not math.isfinite(seconds) or seconds <= 0:
            return
        seen = self._num_seen.get((bucket, key), 0)
        self._num_seen[(bucket, key)] = seen + 1
        if seen == 0:
            return
        old = self._seconds.get((bucket, key))
        self._seconds[(bucket, key)] = seconds if old is None else _blend(old, seconds, COST_RATE)


def _blend(old: float, new: float, rate: float) -> float:
    return (1.0 - rate) * old + rate * new
