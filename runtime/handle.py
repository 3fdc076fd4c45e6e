"""Requests in flight as their callers see them: `RequestHandle` (iterate a request's token
deltas or text, cancel it, wait for its `Output`) and the errors submission raises.

The scheduler's loop thread delivers each step of a request to its handle (`_deliver`) and
nothing else: detokenising and waiting happen in the caller's thread. A handle delivers
either into its own queue (iterated from any one thread) or, for asyncio, to a listener the
loop calls (runtime/async_engine.py hands the steps to the event loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..models.tokenizer import Tokenizer
from .config import SamplingParams
from .stats import RequestStats

logger = logging.getLogger(__name__)

FINISH_CANCELLED = "cancelled"


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the request was not accepted (HTTP 503). Retry later, or
    raise EngineConfig(max_waiting=...)."""


class EngineClosedError(RuntimeError):
    """The engine was closed: it accepts no requests."""


@dataclass(frozen=True)
class Delta:
    """One step of a request: the token ids it emitted (possibly none) and, on its last step,
    why it ended ("stop", "length" or "cancelled")."""

    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Output:
    """One finished request: text, generated ids (a final stop token included), why it ended
    ("stop", "length" or "cancelled"), its wall seconds from submission to the end, the
    seconds to its first token, and its rounds and accepted draft tokens."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    seconds: float
    stats: RequestStats
    first_token_seconds: float = 0.0


class RequestHandle:
    """A submitted request (`Engine.submit`). Safe to use from any thread; iterate it from
    one.

    Iterating yields `Delta`s as rounds complete (`text()` yields text deltas instead);
    `result()` waits for the `Output`; `cancel()` ends the request within one round (its
    slot is freed, `finish_reason` "cancelled"; tokens already delivered stay).
    """

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        tokenizer: Tokenizer | None,
        cancel: Callable[[RequestHandle], None],
        listener: Callable[[Delta], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.submitted = time.perf_counter()
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.first_token_seconds: float | None = None
        self.stats = RequestStats(0, 0)
        self._tokenizer = tokenizer
        self._cancel = cancel
        self._deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._listener = listener or self._deltas.put
        self._finished = threading.Event()
        self._seconds = 0.0

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """Stop decoding this request (no effect once it has finished)."""
        if not self.done:
            self._cancel(self)

    def __iter__(self) -> Iterator[Delta]:
        """The request's steps as they are decoded, the last with its finish reason."""
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return

    def text(self) -> Iterator[str]:
        """Text deltas as tokens are decoded (special tokens skipped); the stream decoder
        holds back bytes that do not yet form whole characters."""
        decoder = self._require_tokenizer().stream_decoder(skip_special_tokens=True)
        for delta in self:
            text = decoder.extend(delta.token_ids)
            if text:
                yield text
        tail = decoder.flush()
        if tail:
            yield tail

    def result(self, timeout: float | None = None) -> Output:
        """Wait for the request to finish (TimeoutError after `timeout` seconds)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        text = ""
        if self._tokenizer is not None:
            text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return Output(
            text=text,
            token_ids=list(self.token_ids),
            prompt_token_ids=self.prompt_token_ids,
            finish_reason=self.finish_reason,
            seconds=self._seconds,
            stats=self.stats,
            first_token_seconds=self.first_token_seconds or 0.0,
        )

    def _require_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError("this request has no tokenizer; iterate its token ids instead")
        return self._tokenizer

    # Called by the scheduler's loop thread only.

    def _deliver(self, token_ids: list[int], finish_reason: str | None = None) -> None:
        if self.done:
            return
        now = time.perf_counter()
        if token_ids and self.first_token_seconds is None:
            self.first_token_seconds = now - self.submitted
        self.token_ids.extend(token_ids)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self._seconds = now - self.submitted
            self._finished.set()
        try:
            self._listener(Delta(token_ids, finish_reason))
        except Exception:
            # A listener's failure ends its own request, never the loop or other requests.
            logger.exception("request %d: its listener failed; cancelling it", self.request_id)
            if finish_reason is None:
                self._cancel(self)

    def _count_round(self, num_accepted: int) -> None:
        self.stats = RequestStats(self.stats.num_rounds + 1, self.stats.num_accepted + num_accepted)
