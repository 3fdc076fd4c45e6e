"""Decoding statistics: per request, per batch, and the engine's running totals and load.

The decoder counts rounds and accepted draft tokens on the host from the reports it reads
anyway, so statistics cost no extra device reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestStats:
    """One request: rounds it took part in and draft tokens the target accepted."""

    num_rounds: int
    num_accepted: int

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round (accepted draft tokens + the bonus)."""
        return (self.num_accepted + self.num_rounds) / self.num_rounds if self.num_rounds else 0.0


@dataclass
class DecodeStats:
    """Statistics of decoding: rounds, accepted draft tokens per slot-round (histogram over
    0..D), prefill and round seconds (GPU time on CUDA, wall time on the CPU), requests, and
    rounds per shape run (RoundVariant.tag: "plain", "D,K,N", ...).

    One object may accumulate several batches (`begin` is called per batch)."""

    num_requests: int = 0
    num_rounds: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    rounds_by_shape: dict[str, int] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    per_request: list[RequestStats] = field(default_factory=list)

    def begin(self, *, depth: int, num_requests: int) -> None:
        """Account for a new batch decoded with trees of `depth` (0: plain decoding)."""
        self.num_requests += num_requests
        missing = depth + 1 - len(self.accepted_histogram)
        self.accepted_histogram.extend([0] * max(missing, 0))

    def add(self, other: DecodeStats) -> None:
        """Add another run's counts to these."""
        self.begin(depth=len(other.accepted_histogram) - 1, num_requests=other.num_requests)
        for depth, count in enumerate(other.accepted_histogram):
            self.accepted_histogram[depth] += count
        self.num_rounds += other.num_rounds
        for shape, count in other.rounds_by_shape.items():
            self.count_shape(shape, count)
        self.prefill_seconds += other.prefill_seconds
        self.round_seconds += other.round_seconds
        self.per_request.extend(other.per_request)

    def count_shape(self, shape: str, num_rounds: int = 1) -> None:
        """Count rounds that ran the shape tagged `shape`."""
        self.rounds_by_shape[shape] = self.rounds_by_shape.get(shape, 0) + num_rounds

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per slot-round (accepted draft tokens + the bonus)."""
        total = sum(self.accepted_histogram)
        if not total:
            return 0.0
        return sum((a + 1) * n for a, n in enumerate(self.accepted_histogram)) / total


@dataclass
class EngineStats:
    """An engine's totals since it was built, and its load now.

    num_requests: requests that ended (finished or cancelled); num_cancelled: those
    cancelled; num_rejected: submissions refused because the waiting queue was full.

    decode_seconds: wall time while some request was admitted or running; prefill_seconds
    and round_seconds: GPU time on CUDA (wall time on the CPU) of prefills and rounds, so
    1 - (prefill_seconds + round_seconds) / decode_seconds is the share of busy wall time the
    device waited for the host. rounds_by_bucket: rounds per "bucket:round", the round being its
    tree and variant (RoundVariant.tag: "4:plain", "4:6,8,40", "4:6,8,40f" top-k/top-p,
    "4:6,8,40s" stochastic). num_rounds_drafts_behind: the plain rounds of an engine with
    trees that left the drafts behind (bare steps that neither append to nor commit the
    pending pairs: the policy found no tree worth keeping them in step, or no live request's
    draft was in step); the other plain rounds kept them in step. num_rounds_exploring: the
    rounds the policy ran to keep acceptance estimates current (a small tree while plain
    decoding was expected to win, or a trial of new requests), not as its best choice.
    """

    num_requests: int = 0
    num_generated_tokens: int = 0
    decode_seconds: float = 0.0
    num_rounds: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    rounds_by_bucket: dict[str, int] = field(default_factory=dict)
    num_rounds_drafts_behind: int = 0
    num_rounds_exploring: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_cancelled: int = 0
    num_rejected: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per slot-round (1.0 for plain decoding)."""
        return DecodeStats(accepted_histogram=self.accepted_histogram).mean_accepted_length

    @property
    def rounds_by_shape(self) -> dict[str, int]:
        """Rounds per round tag ("plain", "6,8,40", ...), every bucket together."""
        found: dict[str, int] = {}
        for key, count in self.rounds_by_bucket.items():
            shape = key.split(":", 1)[1]
            found[shape] = found.get(shape, 0) + count
        return found

    def add_round(
        self,
        key: str,
        seconds: float,
        histogram: list[int],
        *,
        drafts_behind: bool = False,
        exploring: bool = False,
    ) -> None:
        """Count one round of bucket-and-variant `key` and its slots' accepted draft tokens
        (`drafts_behind`: a plain round that left the drafts behind; `exploring`: a round the
        policy ran to explore)."""
        self.num_rounds += 1
        self.num_rounds_drafts_behind += drafts_behind
        self.num_rounds_exploring += exploring
        self.round_seconds += seconds
        self.rounds_by_bucket[key] = self.rounds_by_bucket.get(key, 0) + 1
        totals = self.accepted_histogram
        totals.extend([0] * (len(histogram) - len(totals)))
        for num_accepted, count in enumerate(histogram):
            totals[num_accepted] += count

    def snapshot(self) -> EngineStats:
        return dataclasses.replace(
            self,
            accepted_histogram=list(self.accepted_histogram),
            rounds_by_bucket=dict(self.rounds_by_bucket),
        )

    def since(self, before: EngineStats) -> EngineStats:
        """The totals accumulated from the snapshot `before` to this one (every count, time,
        histogram bin and bucket's rounds; the load, num_running and num_waiting, as now)."""
        totals = {
            f.name: getattr(self, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _NOT_TOTALS
        }
        old = before.accepted_histogram
        old = old + [0] * (len(self.accepted_histogram) - len(old))
        return dataclasses.replace(
            self,
            **totals,
            accepted_histogram=[a - b for a, b in zip(self.accepted_histogram, old, strict=True)],
            rounds_by_bucket={
                key: count - before.rounds_by_bucket.get(key, 0)
                for key, count in self.rounds_by_bucket.items()
                if count > before.rounds_by_bucket.get(key, 0)
            },
        )


# EngineStats fields that `since` does not subtract field by field.
_NOT_TOTALS = frozenset({"accepted_histogram", "rounds_by_bucket", "num_running", "num_waiting"})
