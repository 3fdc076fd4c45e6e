"""The host side of decoding: round reports copied out in launch order without blocking the
GPU, and what a batch's slots did according to them.

On CUDA each report is copied `non_blocking` into pinned host memory behind an event, so
launching the next round never waits, and reading a report waits for that round only. The
decoder keeps `lag + 1` rounds queued before it reads one (`lag` 1 on CUDA, 0 on the CPU):
the GPU never waits for the host, and the host reads each report one round late.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .requests import FINISH_LENGTH, FINISH_STOP
from .round import FINISH_STOP as FINISH_STOP_CODE
from .round import SIGNAL_SCALE, ReportColumns
from .stats import DecodeStats, RequestStats

Step = list[tuple[list[int], str | None]]


def host_lag(device: torch.device) -> int:
    """Rounds the host reads behind the device: 1 on CUDA (one round queued while a report is
    read), 0 on the CPU (nothing runs asynchronously)."""
    return 1 if device.type == "cuda" else 0


class ReportReader:
    """Round reports copied to host memory in launch order, each with a tag (what the caller
    needs to interpret its rows). On CUDA each goes to a pinned buffer behind an event, so
    submitting never blocks and reading waits for that round only; each launch is timed on the
    GPU by an event pair around it."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, run: Callable[[], torch.Tensor], tag: Any = None) -> None:
        """Launch `run` (returns a report [B, C] int64) and queue its copy to the host."""
        if not self._cuda:
            started = time.perf_counter()
            rows = run().tolist()
            self._queue.append((rows, time.perf_counter() - started, tag))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        report = run()
        host = torch.empty(report.shape, dtype=report.dtype, pin_memory=True)
        host.copy_(report, non_blocking=True)
        end.record()
        self._queue.append((host, (start, end), tag))

    def tags(self) -> list[Any]:
        """The tags of the reports not read yet, oldest first."""
        return [tag for _, _, tag in self._queue]

    def read(self) -> tuple[list[list[int]], float, Any]:
        """The oldest report's rows, the seconds its launch took and its tag."""
        report, timing, tag = self._queue.popleft()
        if not self._cuda:
            return report, timing, tag
        start, end = timing
        end.synchronize()
        return report.tolist(), start.elapsed_time(end) / 1e3, tag


def may_still_emit(tokens_left: int, num_in_flight: int) -> bool:
    """Whether a round launched now may emit for a request with `tokens_left` as far as the
    reports read say: a round emits at least one token for each request it does not end, so
    a request with no more tokens left than rounds in flight (launched, not read) ends with
    them."""
    return not num_in_flight or tokens_left > num_in_flight


def row_tokens(row: list[int]) -> list[int]:
    """The tokens a report row emitted."""
    cols = ReportColumns
    return row[cols.TOKENS : cols.TOKENS + row[cols.NUM_EMITTED]]


def row_signals(row: list[int]) -> tuple[float, float]:
    """A round row's acceptance signals: the draft's confidence and its KL divergence from
    the target at the root (round.acceptance_signals; 0, 0 for plain rounds)."""
    cols = ReportColumns
    return row[cols.CONFIDENCE] / SIGNAL_SCALE, row[cols.DIVERGENCE] / SIGNAL_SCALE


def row_finish(row: list[int]) -> str:
    """The finish reason of a row whose slot is done: "stop" or "length"."""
    return FINISH_STOP if row[ReportColumns.FINISH] == FINISH_STOP_CODE else FINISH_LENGTH


class SlotTracker:
    """The host's view of a static batch, updated from reports: which slots are done, and each
    slot's tokens, rounds and accepted draft tokens."""

    def __init__(self, num_slots: int) -> None:
        self.done = [False] * num_slots
        self.num_tokens = [0] * num_slots
        self.num_rounds = [0] * num_slots
        self.num_accepted = [0] * num_slots

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def step(self, rows: list[list[int]], stats: DecodeStats, *, counts_round: bool) -> Step:
        """New tokens and finish reasons of one report; round statistics when it is a round."""
        step: Step = []
        cols = ReportColumns
        for slot, row in enumerate(rows[: len(self.done)]):
            was_done = self.done[slot]
            ended = bool(row[cols.DONE]) and not was_done
            tokens = row_tokens(row)
            self.num_tokens[slot] += len(tokens)
            step.append((tokens, row_finish(row) if ended else None))
            self.done[slot] = bool(row[cols.DONE])
            if counts_round and not was_done:
                self.num_rounds[slot] += 1
                self.num_accepted[slot] += row[cols.NUM_ACCEPTED]
                stats.accepted_histogram[row[cols.NUM_ACCEPTED]] += 1
        stats.num_rounds += counts_round
        return step

    def request_stats(self) -> list[RequestStats]:
        return [
            RequestStats(rounds, accepted)
            for rounds, accepted in zip(self.num_rounds, self.num_accepted, strict=True)
        ]
