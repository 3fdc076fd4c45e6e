"""Prometheus metrics of a server, in a registry of its own (several apps in one process do not
collide): the engine's load and totals are read from `Engine.stats()` at scrape time, the
policy's round costs from `Engine.round_costs()` (which waits for the decoding loop to be
between rounds, so a scrape runs off the event loop); the latencies clients see are observed
by the routes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..runtime.async_engine import AsyncEngine

_LATENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.0, 5.0, 10.0, 30.0,
)  # fmt: skip


class ServerMetrics:
    """The registry `/metrics` renders, and the histograms the routes observe."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.time_to_first_token = Histogram(
            "specrun_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "specrun_inter_token_latency_seconds",
            "Seconds per generated token after the first (a step's gap over its tokens).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "specrun_request_latency_seconds",
            "Seconds from a request's arrival to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        yield GaugeMetricFamily(
            "specrun_requests_running", "Requests decoding now.", value=stats.num_running
        )
        yield GaugeMetricFamily(
            "specrun_requests_waiting", "Requests waiting for a slot.", value=stats.num_waiting
        )
        for name, text, value in (
            ("specrun_generated_tokens", "Tokens generated.", stats.num_generated_tokens),
            ("specrun_requests_finished", "Requests ended (cancelled ones too).",
             stats.num_requests),
            ("specrun_requests_cancelled", "Requests cancelled.", stats.num_cancelled),
            ("specrun_requests_rejected", "Requests refused: waiting queue full.",
             stats.num_rejected),
            ("specrun_active_seconds", "Wall seconds with some request admitted or running.",
             stats.decode_seconds),
            ("specrun_device_busy_seconds", "Seconds of prefills and rounds (GPU time on CUDA).",
             stats.prefill_seconds + stats.round_seconds),
            ("specrun_rounds_drafts_behind", "Plain rounds that left the drafts behind (the "
             "speculation policy judged no tree worth keeping them in step).",
             stats.num_rounds_drafts_behind),
            ("specrun_rounds_exploring", "Rounds the speculation policy ran to keep its "
             "acceptance estimates current, not as its best choice.",
             stats.num_rounds_exploring),
        ):  # fmt: skip
            yield CounterMetricFamily(name, text, value=value)
        rounds = CounterMetricFamily(
            "specrun_rounds",
            "Rounds run, per bucket and round (tree D,K,N or plain; f: top-k/top-p, s: "
            "stochastic).",
            labels=["bucket", "round"],
        )
        for key, count in sorted(stats.rounds_by_bucket.items()):
            rounds.add_metric(key.split(":", 1), count)
        yield rounds
        costs = GaugeMetricFamily(
            "specrun_round_cost_milliseconds",
            "What the speculation policy takes a round to cost now (measured at warm-up or "
            "loaded from a profile, moved by the rounds timed since), per bucket and round.",
            labels=["bucket", "round"],
        )
        for key, milliseconds in self._engine.round_costs().items():
            costs.add_metric(key.split(":", 1), milliseconds)
        yield costs
        yield _accepted_length(stats.accepted_histogram)


def _accepted_length(histogram: list[int]) -> HistogramMetricFamily:
    """Tokens each slot emitted per round (accepted draft tokens + 1), as a histogram."""
    buckets, total = [], 0
    for num_accepted, count in enumerate(histogram):
        total += count
        buckets.append((str(float(num_accepted + 1)), total))
    buckets.append(("+Inf", total))
    length_sum = sum((a + 1) * n for a, n in enumerate(histogram))
    return HistogramMetricFamily(
        "specrun_accepted_length",
        "Tokens a slot emitted per round (accepted draft tokens + the bonus).",
        buckets=buckets,
        sum_value=length_sum,
    )
