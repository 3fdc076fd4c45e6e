"""Continuous batching: one loop thread owns the decoder and runs rounds over the live
requests while others arrive and leave.

Requests are submitted from any thread into a bounded FIFO waiting queue (beyond it,
`EngineOverloadedError`). Between rounds the loop
- runs calls posted to it (warm-up, which must not race the rounds);
- retires cancelled requests (their slots are released on the device);
- prefills up to `max_prefill_tokens` prompt tokens, chosen by runtime/admission.py: the
  next chunk of each prompt prefilled in chunks, then waiting requests in FIFO order into
  the lowest free slots. A prompt that fits is prefilled whole: into an idle decoder as one
  batch prefill of the bucket (its prefill graph on CUDA), into a running one with
  `Decoder.admit` (the others keep their KV caches and positions); without the head when
  the policy leaves the new requests' drafts behind from the start
  (RoundPlanner.drafts_prompts). A longer one reserves its slot and is prefilled in chunks,
  one a pass (runtime/chunked_prefill.py), so the running requests keep getting a round
  every pass. A reserved slot counts as occupied (for admissions and the bucket) but stays
  done on the device, so rounds skip it, until its last chunk installs the prompt's state
  into it and delivers the root token. With `continuous=False` requests are admitted
  whole, the first always, and only into an idle decoder (static batches, the baseline
  continuous batching is measured against);
- runs the smallest bucket that holds the highest live slot: a batch grows into a larger
  bucket without copying (every bucket views the first slots of one store) and, when the live
  requests fit a smaller bucket and nobody waits, its live slots above that bucket move down;
- launches one round of that bucket, its tree chosen by the decoder's speculation policy
  from the live requests' acceptance estimates (runtime/policies/) and its variant from their
  parameters, and reads the reports one round late, delivering each request's tokens to its
  handle and each row's accepted drafts to the request's estimate.

Every launch goes into the one CUDA stream in order, so a slot released or moved between
rounds is free once the rounds queued before have run; each report carries the owners of
its rows at launch, so rows of a slot's former owner are never given to its new one. Nothing
in a round synchronises with the host; the loop waits only on the oldest report's event.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models.tokenizer import Tokenizer
from .acceptance import AcceptanceEstimate
from .admission import Prefills, take_prefills
from .chunked_prefill import ChunkedPrefill
from .config import PADDING_PARAMS, SamplingParams
from .decoder import Decoder, settle_heap
from .handle import FINISH_CANCELLED, Delta, EngineClosedError, EngineOverloadedError, RequestHandle
from .reports import ReportReader, may_still_emit, row_finish, row_signals, row_tokens
from .round import ReportColumns
from .round_plan import RoundVariant
from .stats import EngineStats
from .threads import CallResult

logger = logging.getLogger(__name__)


class Scheduler:
    """The loop over a decoder's buckets. Thread-safe: `submit`, `cancel`, `call` and `close`
    may be called from any thread; everything else runs on the loop thread, started on first
    use (or, with `threaded=False`, in whoever calls `step`: tests drive the loop pass by
    pass).

    Args:
        decoder: owns the state and graphs; used only from the loop thread from now on.
        tokenizer: given to handles for their text (None: token ids only).
        max_waiting: requests that may wait for a slot; more fail with EngineOverloadedError.
        max_prefill_tokens: prompt tokens prefilled per pass, i.e. between two rounds; longer
            prompts are prefilled in chunks (with `continuous`).
        continuous: admit while requests decode (False: only into an idle decoder, so each
            batch runs until its last request ends: static batching, for comparison).
        threaded: run the loop on its own thread (False: `step` runs one pass).
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        tokenizer: Tokenizer | None,
        max_waiting: int,
        max_prefill_tokens: int,
        continuous: bool = True,
        threaded: bool = True,
    ) -> None:
        self.decoder = decoder
        self._threaded = threaded
        self._tokenizer = tokenizer
        self._max_waiting = max_waiting
        self._max_prefill_tokens = max_prefill_tokens
        self._continuous = continuous
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._cancels: list[RequestHandle] = []
        self._calls: deque[tuple[Callable[[], Any], CallResult]] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._stats = EngineStats()
        # Loop thread only (read under the lock by the wait condition).
        self._slots: list[RequestHandle | None] = [None] * decoder.num_slots
        # Requests whose prompts are being prefilled in chunks, oldest first.
        self._chunks: dict[RequestHandle, ChunkedPrefill] = {}
        self._bucket = decoder.config.buckets[0]
        self._reader = ReportReader(decoder.device)
        self._acceptance = decoder.planner.new_book()
        self._active_since: float | None = None

    # Any thread.

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        listener: Callable[[Delta], None] | None = None,
        block: bool = False,
    ) -> RequestHandle:
        """Queue a validated request. With `block`, wait for room in the waiting queue;
        else raise EngineOverloadedError when it is full."""
        handle = self._handle(prompt, params, listener=listener)
        self._queue([handle], block=block)
        return handle

    def submit_all(
        self, requests: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[RequestHandle]:
        """Queue validated (prompt, params) requests together, waiting for room in the
        waiting queue: the loop admits them in one pass as far as slots and the prefill
        budget allow, instead of starting the first alone while the rest are queued."""
        handles = [self._handle(prompt, params) for prompt, params in requests]
        self._queue(handles, block=True)
        return handles

    def _handle(self, prompt, params, *, listener=None) -> RequestHandle:
        return RequestHandle(
            next(self._ids),
            prompt,
            params,
            tokenizer=self._tokenizer,
            cancel=self.cancel,
            listener=listener,
        )

    def _queue(self, handles: list[RequestHandle], *, block: bool) -> None:
        """Append `handles` to the waiting queue as room allows (all at once when it has
        room for them), waiting for room with `block`, else raising EngineOverloadedError
        when it is full. If the wait ends in an error (the engine closed, an interrupt),
        the handles already queued are cancelled."""
        num_queued = 0
        try:
            with self._cond:
                while num_queued < len(handles):
                    self._ensure_running()
                    room = self._max_waiting - len(self._waiting)
                    if room <= 0 and not block:
                        self._stats.num_rejected += 1
                        raise EngineOverloadedError(
                            f"{len(self._waiting)} requests are already waiting for a slot "
                            f"(max_waiting={self._max_waiting}); retry later or raise "
                            "EngineConfig(max_waiting=...)"
                        )
                    if room <= 0:
                        self._cond.wait()
                        continue
                    self._waiting.extend(handles[num_queued : num_queued + room])
                    num_queued = min(len(handles), num_queued + room)
                    self._stats.num_waiting = len(self._waiting)
                    self._cond.notify_all()
        except BaseException:
            for handle in handles[:num_queued]:
                self.cancel(handle)
            raise

    def cancel(self, handle: RequestHandle) -> None:
        """End a request: a waiting one at once, a running one before the next round."""
        with self._cond:
            if handle in self._waiting:
                self._waiting.remove(handle)
                self._stats.num_waiting = len(self._waiting)
                self._stats.num_cancelled += 1
                self._stats.num_requests += 1
                handle._deliver([], FINISH_CANCELLED)
            else:
                self._cancels.append(handle)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between rounds (directly when no loop runs) and return
        its result (or raise its exception)."""
        with self._cond:
            if self._thread is None or threading.current_thread() is self._thread:
                fn_now = True
            else:
                fn_now = False
                result = CallResult()
                self._calls.append((fn, result))
                self._cond.notify_all()
        return fn() if fn_now else result.wait()

    def stats(self) -> EngineStats:
        """A snapshot of the running totals and the current load. A request's rounds, tokens
        and count are in them by the time its result is delivered; rounds launched ahead for
        slots that have finished are counted when their reports are read (`wait_idle`)."""
        with self._cond:
            snapshot = self._stats.snapshot()
            if self._active_since is not None:
                snapshot.decode_seconds += time.perf_counter() - self._active_since
            return snapshot

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request waits or decodes and no round is in flight, so that
        `stats()` holds all the work submitted so far; False if `timeout` seconds pass first.
        Once the scheduler is closing it returns True at once. Without a loop thread
        (`threaded=False`) the calling thread runs the passes left."""
        if not self._threaded:
            while self.step():
                pass
            return True
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closing or not (self._waiting or self._active_since is not None),
                timeout,
            )

    def close(self, *, cancel: bool = True) -> None:
        """Stop the loop: cancel every request (or, without `cancel`, let the running and
        waiting ones finish first), then join the thread. Later submissions raise
        EngineClosedError."""
        with self._cond:
            self._closing = True
            if cancel:
                while self._waiting:
                    handle = self._waiting.popleft()
                    handle._deliver([], FINISH_CANCELLED)
                self._cancels.extend(h for h in self._slots if h is not None)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def step(self) -> bool:
        """One pass of the loop in the calling thread (`threaded=False` only): whether there
        was anything to do."""
        assert not self._threaded, "a threaded scheduler runs its own loop"
        with self._cond:
            if not self._has_work():
                return False
        with torch.inference_mode():
            self._iterate()
        return True

    @property
    def slots(self) -> list[RequestHandle | None]:
        """Which request owns each slot (loop thread, or `threaded=False`)."""
        return list(self._slots)

    def _ensure_running(self) -> None:
        if self._closing:
            raise EngineClosedError("the engine is closed; build a new one")
        if self._thread is None and self._threaded:
            self._thread = threading.Thread(target=self._loop, name="specrun-loop", daemon=True)
            self._thread.start()

    # The loop thread.

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while self._iterate():
                    pass
        except BaseException:
            logger.exception("the decoding loop failed; every request in flight is cancelled")
            self._fail_all()
            raise

    def _iterate(self) -> bool:
        """One pass between rounds; False when the loop should end."""
        with self._cond:
            while not self._has_work():
                if self._closing:
                    return False
                self._cond.wait()
            calls, self._calls = self._calls, deque()
            cancels, self._cancels = self._cancels, []
        for fn, result in calls:
            result.run(fn)
        self._retire(cancels)
        with self._cond:
            free = [s for s, h in enumerate(self._slots) if h is None] if self._can_admit() else []
            prefills = take_prefills(
                self._waiting,
                self._chunks,
                free,
                budget=self._max_prefill_tokens,
                continuous=self._continuous,
            )
            self._stats.num_waiting = len(self._waiting)
            if prefills:
                self._mark_active()  # before the lock is left: wait_idle sees no gap
            has_waiting = bool(self._waiting)
            self._cond.notify_all()  # room in the waiting queue
        if prefills:
            self._prefill(prefills)
        self._resize(shrink=not has_waiting)
        launched = self._launch_round()
        self._read_reports(launched=launched)
        return True

    def _has_work(self) -> bool:
        free = self._can_admit() and any(h is None for h in self._slots)
        return bool(
            self._calls
            or self._cancels
            or (self._waiting and free)
            or self._num_live()
            or len(self._reader)
        )

    def _num_live(self) -> int:
        return sum(h is not None for h in self._slots)

    def _can_admit(self) -> bool:
        return self._continuous or not (self._num_live() or len(self._reader))

    def _retire(self, cancels: list[RequestHandle]) -> None:
        """Free the slots of cancelled requests (marked done on the device) and end them."""
        slots = []
        for handle in cancels:
            if handle.done:
                continue
            self._chunks.pop(handle, None)
            for slot, owner in enumerate(self._slots):
                if owner is handle:
                    self._slots[slot] = None
                    slots.append(slot)
            with self._cond:
                self._stats.num_cancelled += 1
            self._finish(handle, FINISH_CANCELLED)
        if slots:
            self.decoder.release(self._bucket, slots)

    def _prefill(self, prefills: Prefills) -> None:
        """Reserve the slots of requests starting chunks, run the pass's chunks, then prefill
        the requests admitted whole."""
        for slot, handle in prefills.reserved:
            self._slots[slot] = handle
            prompt, params = handle.prompt_token_ids, handle.params
            self._chunks[handle] = self.decoder.start_chunked_prefill(prompt, params)
        self._mark_active()
        for handle, max_tokens in prefills.chunks:
            self._prefill_chunk(handle, max_tokens)
        if prefills.whole:
            self._admit(prefills.whole)

    def _prefill_chunk(self, handle: RequestHandle, max_tokens: int) -> None:
        """Run the request's next chunk and queue its report: empty until the last chunk,
        which installs the prompt's state into the slot the request holds now (moves may
        have relocated the reservation) and reports the root token."""
        chunked = self._chunks[handle]
        slot = self._slots.index(handle)
        run = functools.partial(self.decoder.prefill_chunk, chunked, max_tokens, slot=slot)
        self._reader.submit(run, tag=("prefill", [handle]))
        if chunked.finished:
            del self._chunks[handle]

    def _admit(self, admitted: list[tuple[int, RequestHandle]]) -> None:
        """Prefill requests whole into their slots and queue the prefill's report."""
        idle = not any(self._decoding(len(self._slots)))
        slots = [slot for slot, _ in admitted]
        handles = [handle for _, handle in admitted]
        for slot, handle in admitted:
            self._slots[slot] = handle
        self._mark_active()
        bucket = self.decoder.config.bucket_for(max(slots) + 1)
        prompts = [h.prompt_token_ids for h in handles]
        params = [h.params for h in handles]
        estimates = [self._acceptance.get(h, kind=h.params.greedy) for h in handles]
        drafted = self.decoder.planner.drafts_prompts(bucket, params, estimates)
        if idle and slots == list(range(len(slots))):
            # Nothing decodes: a batch prefill of the whole bucket (graph-captured on CUDA);
            # it leaves the padding rows done, as slots reserved for chunks must stay.
            padding = bucket - len(slots)
            prompts += [[0]] * padding
            params += [PADDING_PARAMS] * padding
            run = functools.partial(
                self.decoder.prefill_batch, bucket, prompts, params, drafted=drafted
            )
        else:
            run = functools.partial(
                self.decoder.admit, bucket, slots, prompts, params, drafted=drafted
            )
        self._reader.submit(run, tag=("prefill", handles))

    def _resize(self, *, shrink: bool) -> None:
        """Run the smallest bucket holding every live slot; with `shrink` (nobody waits),
        move live slots down into a smaller bucket once they fit it."""
        live = [slot for slot, h in enumerate(self._slots) if h is not None]
        if not live:
            return
        config = self.decoder.config
        fits = config.bucket_for(len(live))
        span = config.bucket_for(live[-1] + 1)
        if shrink and span > fits:
            sources = [slot for slot in live if slot >= fits]
            dests = [slot for slot in range(fits) if self._slots[slot] is None][: len(sources)]
            self.decoder.move(span, sources, dests)
            for source, dest in zip(sources, dests, strict=True):
                self._slots[dest], self._slots[source] = self._slots[source], None
            live = sorted(dests + [slot for slot in live if slot < fits])
        self._bucket = config.bucket_for(live[-1] + 1)

    def _launch_round(self) -> bool:
        """Launch the bucket's next round for the requests that may still emit: whether one
        was launched. A round emits at least one token for each request it does not end, so
        a request whose rounds in flight (those launched, not yet read) are at least its
        tokens left ends with them: the round after is not launched for it alone, and the
        policy does not count it."""
        bucket = self._bucket
        owners = self._decoding(bucket)
        in_flight = self._rounds_in_flight()
        tokens_left = {h: self._tokens_left(h) for h in owners if h is not None}
        live = [h for h, n in tokens_left.items() if may_still_emit(n, in_flight[h])]
        left = {h: n - in_flight[h] for h, n in tokens_left.items()}
        if not live:
            return False
        params = [h.params for h in live]
        estimates = self._estimates(live, left) if self.decoder.planner.speculates else []
        variant = self.decoder.planner.plan(bucket, params, estimates)
        if self.decoder.use_graphs and (bucket, variant) not in self.decoder.warmups:
            self.decoder.prepare(bucket, variant=variant, prefill=False)
            settle_heap()
        run = self.decoder.round_runner(bucket, variant=variant)
        explored = self.decoder.planner.explored
        self._reader.submit(run, tag=("round", list(owners), (bucket, variant), explored))
        return True

    def _rounds_in_flight(self) -> Counter[RequestHandle]:
        """Per request, the rounds launched for it whose reports are not read yet."""
        counts: Counter[RequestHandle] = Counter()
        for tag in self._reader.tags():
            if tag[0] == "round":
                counts.update(h for h in tag[1] if h is not None)
        return counts

    @staticmethod
    def _tokens_left(handle: RequestHandle) -> int:
        """The tokens the request may still generate, as far as the reports read say."""
        return handle.params.max_new_tokens - len(handle.token_ids)

    def _estimates(
        self, live: list[RequestHandle], left: dict[RequestHandle, int]
    ) -> list[AcceptanceEstimate]:
        """The live requests' acceptance estimates, told what a static batch's projection
        needs: each request's tokens left after the rounds in flight (`left`, each counted
        as one token) and its batch's likely slowest (while nobody waits)."""
        estimates = [self._acceptance.get(h, kind=h.params.greedy) for h in live]
        nobody_waits = not self._waiting
        for handle, estimate in zip(live, estimates, strict=True):
            estimate.remaining = max(left[handle], 1) if nobody_waits else None
            estimate.slowest = (
                self._acceptance.slowest_of(estimate.kind, len(live)) if nobody_waits else None
            )
        return estimates

    def _decoding(self, bucket: int) -> list[RequestHandle | None]:
        """The owners of the bucket's slots as its rounds see them: None for free slots and
        for slots reserved for chunked prompts (done on the device until installed)."""
        return [None if h in self._chunks else h for h in self._slots[:bucket]]

    def _read_reports(self, *, launched: bool) -> None:
        """Read the reports beyond the host's lag, and every one once no round was launched
        (nothing to decode, or only rounds in flight left to end it)."""
        while len(self._reader) > self.decoder.host_lag or (len(self._reader) and not launched):
            rows, seconds, tag = self._reader.read()
            if tag[0] == "prefill":
                self._on_prefill(rows, tag[1], seconds)
            else:
                self._on_round(rows, tag[1], tag[2], seconds, explored=tag[3])
        if not self._num_live() and not len(self._reader):
            self._mark_idle()

    def _on_prefill(self, rows: list[list[int]], handles: list[RequestHandle], seconds: float):
        with self._cond:
            self._stats.prefill_seconds += seconds
        for row, handle in zip(rows, handles, strict=False):
            self._deliver(handle, row)

    def _on_round(
        self, rows, owners, launched: tuple[int, RoundVariant], seconds: float, *, explored: bool
    ) -> None:
        bucket, variant = launched
        # Without trees nothing reads the acceptance estimates: no bookkeeping per request.
        speculates = self.decoder.planner.speculates
        histogram = [0] * (self.decoder.max_depth + 1)
        accepted = []
        live = [
            (row, h) for row, h in zip(rows, owners, strict=True) if h is not None and not h.done
        ]
        for row, handle in live:
            num_accepted = row[ReportColumns.NUM_ACCEPTED]
            handle._count_round(num_accepted)
            histogram[num_accepted] += 1
            accepted.append(num_accepted)
            if speculates:
                self._acceptance.observe(handle, variant.tree, num_accepted, row_signals(row))
        self.decoder.planner.done(bucket, variant, seconds, accepted)
        with self._cond:
            self._stats.add_round(
                f"{bucket}:{variant.tag}",
                seconds,
                histogram,
                drafts_behind=speculates and variant.bare,
                exploring=explored,
            )
        # After the round is counted: a caller woken by its result sees it in the stats.
        for row, handle in live:
            self._deliver(handle, row)

    def _deliver(self, handle: RequestHandle, row: list[int]) -> None:
        tokens = row_tokens(row)
        with self._cond:
            self._stats.num_generated_tokens += len(tokens)
        if row[ReportColumns.DONE]:
            for slot, owner in enumerate(self._slots):
                if owner is handle:
                    self._slots[slot] = None
            self._finish(handle, row_finish(row), tokens)
        elif tokens:
            handle._deliver(tokens)

    def _finish(self, handle: RequestHandle, reason: str, tokens: list[int] = ()) -> None:
        self._acceptance.forget(handle)
        with self._cond:
            self._stats.num_requests += 1
            self._stats.num_running = self._num_live()
        handle._deliver(list(tokens), reason)

    def _mark_active(self) -> None:
        with self._cond:
            if self._active_since is None:
                self._active_since = time.perf_counter()
            self._stats.num_running = self._num_live()

    def _mark_idle(self) -> None:
        with self._cond:
            if self._active_since is not None:
                self._stats.decode_seconds += time.perf_counter() - self._active_since
                self._active_since = None
                self._cond.notify_all()  # wait_idle

    def _fail_all(self) -> None:
        with self._cond:
            self._closing = True
            handles = [*self._waiting, *(h for h in self._slots if h is not None)]
            self._waiting.clear()
            for fn_result in self._calls:
                fn_result[1].fail(EngineClosedError("the decoding loop failed"))
            self._cond.notify_all()
        for handle in handles:
            handle._deliver([], FINISH_CANCELLED)
