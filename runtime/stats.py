"""Decoding statistics: per request, per batch, and the engine's running totals.

The decoder counts rounds and accepted draft tokens on the host from the reports it reads
anyway, so statistics cost no extra device reads.
"""

from __future__ import annotations

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
    0..D), prefill and round seconds (GPU time on CUDA, wall time on the CPU), requests.

    One object may accumulate several batches (`begin` is called per batch)."""

    num_requests: int = 0
    num_rounds: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
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
        self.prefill_seconds += other.prefill_seconds
        self.round_seconds += other.round_seconds
        self.per_request.extend(other.per_request)

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per slot-round (accepted draft tokens + the bonus)."""
        total = sum(self.accepted_histogram)
        if not total:
            return 0.0
        return sum((a + 1) * n for a, n in enumerate(self.accepted_histogram)) / total
