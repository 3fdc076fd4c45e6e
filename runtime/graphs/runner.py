"""CUDA-graph capture and replay of zero-argument steps over static buffers.

The runner knows no model. A step is a callable that reads and writes tensors whose addresses
never change (the caller's static buffers) and returns its outputs; the runner warms it up on
a side stream (which also triggers compilation and autotuning), captures it on one capture
stream into one memory pool shared by every graph, and replays it. Capture the largest bucket
first: later, smaller graphs then reuse the pool's blocks. Graphs sharing a pool must never run
concurrently, and a graph's outputs are valid until the next replay of any graph: callers copy
them out (the decoder copies its report to pinned memory) before replaying another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class CapturedGraph:
    """One captured step: the graph, its static outputs, what capturing it cost.

    warmup_seconds: the eager warm-up calls (compilation included); capture_seconds: the
    capture itself; pool_bytes: memory the shared pool grew by for this graph.
    """

    graph: torch.cuda.CUDAGraph
    outputs: Any
    warmup_seconds: float
    capture_seconds: float
    pool_bytes: int


class CudaGraphRunner:
    """Captures steps under keys (for instance batch buckets) and replays them.

    Args:
        device: the CUDA device the steps run on.
        num_warmup: eager calls on a side stream before capture (compilation, autotuning and
            lazy initialisation must not happen during capture).
    """

    def __init__(self, device: torch.device | str, *, num_warmup: int = 2) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if num_warmup < 1:
            raise ValueError(f"num_warmup must be at least 1, got {num_warmup}")
        self.num_warmup = num_warmup
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_stream = torch.cuda.Stream(self.device)
        self.graphs: dict[Hashable, CapturedGraph] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def capture(self, key: Hashable, step: Callable[[], Any]) -> CapturedGraph:
        """Warm up `step`, capture it under `key` and return the capture (outputs included).

        The warm-up calls run the step for real: the caller puts its buffers in a state where
        that is harmless (and resets them before real use). The device's default RNG is left
        as it was found: a seeded request that triggers a capture samples what it would have
        sampled with the graph already captured."""
        if key in self.graphs:
            raise ValueError(f"a graph is already captured under {key!r}")
        with torch.random.fork_rng(devices=[self.device], device_type="cuda"):
            captured = self._warm_up_and_capture(step)
        self.graphs[key] = captured
        logger.info(
            "captured %r: warm-up %.2f s, capture %.2f s, +%.1f MiB",
            key,
            captured.warmup_seconds,
            captured.capture_seconds,
            captured.pool_bytes / 2**20,
        )
        return captured

    def _warm_up_and_capture(self, step: Callable[[], Any]) -> CapturedGraph:
        started = time.perf_counter()
        self.capture_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.capture_stream):
            for _ in range(self.num_warmup):
                step()
        torch.cuda.current_stream(self.device).wait_stream(self.capture_stream)
        torch.cuda.synchronize(self.device)
        warmed = time.perf_counter()
        # torch.cuda.graph empties the cache on entry: measure from an empty cache too.
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            outputs = step()
        torch.cuda.synchronize(self.device)
        return CapturedGraph(
            graph=graph,
            outputs=outputs,
            warmup_seconds=warmed - started,
            capture_seconds=time.perf_counter() - warmed,
            pool_bytes=torch.cuda.memory_reserved(self.device) - reserved,
        )

    def replay(self, key: Hashable) -> Any:
        """Replay the graph under `key` on the current stream; returns its static outputs
        (overwritten by the next replay of any graph of this runner)."""
        captured = self.graphs[key]
        captured.graph.replay()
        return captured.outputs

    def close(self) -> None:
        """Free every graph and the pool's memory."""
        for captured in self.graphs.values():
            captured.graph.reset()
        self.graphs.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
