"""The Engine for asyncio services: `await engine.generate(...)`, `async for delta in
engine.stream(...)`, `engine.submit(...)` for a request's token deltas; a request whose task
is cancelled (or whose stream is closed early) is cancelled in the engine.

The engine's loop thread hands each step to the event loop with `call_soon_threadsafe`, so a
coroutine waiting for tokens never blocks the event loop, and the loop thread never waits for
a coroutine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from .config import EngineConfig, SamplingParams
from .engine import Engine, Prompt
from .handle import Delta, Output, RequestHandle
from .stats import EngineStats


class AsyncRequest:
    """A submitted request seen from asyncio: iterate its Deltas (`async for`), `cancel()` it;
    `handle` is the underlying RequestHandle (prompt ids, tokens so far, statistics)."""

    def __init__(self, engine: Engine, ids: list[int], params: SamplingParams) -> None:
        self._loop = asyncio.get_running_loop()
        self._deltas: asyncio.Queue[Delta] = asyncio.Queue()
        self.handle: RequestHandle = engine.submit(ids, params, listener=self._put)

    def _put(self, delta: Delta) -> None:
        """Called on the engine's loop thread: hand the delta to the event loop (a closed
        event loop raises, and the handle cancels the request)."""
        self._loop.call_soon_threadsafe(self._deltas.put_nowait, delta)

    def cancel(self) -> None:
        self.handle.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while True:
                delta = await self._deltas.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self.handle.cancel()  # no effect once finished; else the consumer left early


class AsyncEngine:
    """An Engine driven from asyncio. Build with `AsyncEngine.from_pretrained(...)` (the same
    arguments as Engine's) or around an Engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path | None = None,
        *,
        draft: str | Path | bool | None = None,
        config: EngineConfig | None = None,
        artifacts: str | Path | None = None,
    ) -> AsyncEngine | None:
        """Engine.from_pretrained's engine, driven from asyncio (None on the ranks other than
        0 of a tensor-parallel engine under torchrun, once rank 0 has closed it)."""
        engine = Engine.from_pretrained(model_dir, draft=draft, config=config, artifacts=artifacts)
        return None if engine is None else cls(engine)

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncRequest:
        """Queue one request (inside a running event loop). Raises ValueError/TypeError for a
        bad request and EngineOverloadedError when the waiting queue is full, at once."""
        ids, params = self.engine.encode_request(prompt, params)
        return AsyncRequest(self.engine, ids, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[str]:
        """Text deltas of one request. Validated at the call; queued when first iterated."""
        ids, params = self.engine.encode_request(prompt, params)
        return self._stream(ids, params)

    async def _stream(self, ids: list[int], params: SamplingParams) -> AsyncIterator[str]:
        decoder = self.engine.tokenizer.stream_decoder(skip_special_tokens=True)
        async for delta in AsyncRequest(self.engine, ids, params):
            text = decoder.extend(delta.token_ids)
            if text:
                yield text
        tail = decoder.flush()
        if tail:
            yield tail

    async def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[Output]:
        """Decode prompts (one or a list) to completion; cancelling the awaiting task cancels
        them in the engine."""
        requests = [self.submit(p, params) for p in _prompt_list(prompts)]
        try:
            for request in requests:
                async for _ in request:
                    pass
        finally:
            for request in requests:
                request.cancel()
        return [request.handle.result(timeout=0) for request in requests]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Engine.wait_idle, without blocking the event loop."""
        return await asyncio.to_thread(self.engine.wait_idle, timeout)

    def round_costs(self) -> dict[str, float]:
        """Engine.round_costs: blocks until the decoding loop is between rounds."""
        return self.engine.round_costs()

    def close(self) -> None:
        self.engine.close()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)
