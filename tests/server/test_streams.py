"""server/streams.py: several async iterators read as one, each item tagged with its
iterator's index, in the order the items come; an iterator's error raised at once; every
iterator closed however the merged one ends."""

from __future__ import annotations

import asyncio

import pytest

from specrun.server.streams import merged


class Source:
    """Yields `items`, waiting on an event before each (the test decides the order), and
    records whether it was closed."""

    def __init__(self, items, *, fail_after: int | None = None) -> None:
        self.items, self.fail_after = items, fail_after
        self.go = [asyncio.Event() for _ in items]
        self.closed = False

    async def __call__(self):
        try:
            for i, item in enumerate(self.items):
                if i == self.fail_after:
                    raise RuntimeError("source failed")
                await self.go[i].wait()
                yield item
        finally:
            self.closed = True


async def _take(stream, count: int) -> list:
    return [await anext(stream) for _ in range(count)]


def test_items_come_in_arrival_order_tagged_by_index():
    async def main():
        a, b = Source(["a0", "a1"]), Source(["b0"])
        stream = merged([a(), b()])
        for event in (b.go[0], a.go[0], a.go[1]):
            event.set()
        got = [pair async for pair in stream]
        assert sorted(got) == [(0, "a0"), (0, "a1"), (1, "b0")]
        assert got.index((0, "a0")) < got.index((0, "a1"))
        assert a.closed and b.closed

    asyncio.run(main())


def test_a_slow_iterator_does_not_hold_back_the_others():
    async def main():
        slow, fast = Source(["s0"]), Source(["f0", "f1"])
        stream = merged([slow(), fast()])
        fast.go[0].set()
        fast.go[1].set()
        assert await asyncio.wait_for(_take(stream, 2), 5) == [(1, "f0"), (1, "f1")]
        slow.go[0].set()
        assert await anext(stream) == (0, "s0")
        await stream.aclose()

    asyncio.run(main())


def test_closing_early_closes_every_iterator():
    async def main():
        a, b = Source(["a0", "a1"]), Source(["b0"])
        stream = merged([a(), b()])
        a.go[0].set()
        assert await anext(stream) == (0, "a0")
        await stream.aclose()
        assert a.closed and b.closed

    asyncio.run(main())


def test_cancelling_the_reader_closes_every_iterator():
    async def main():
        a, b = Source(["a0"]), Source(["b0"])
        task = asyncio.create_task(_take(merged([a(), b()]), 1))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert a.closed and b.closed

    asyncio.run(main())


def test_an_iterators_error_is_raised_at_once_and_the_others_closed():
    async def main():
        failing, waiting = Source(["x0", "x1"], fail_after=1), Source(["w0"])
        stream = merged([failing(), waiting()])
        failing.go[0].set()
        assert await anext(stream) == (0, "x0")
        with pytest.raises(RuntimeError, match="source failed"):
            await asyncio.wait_for(anext(stream), 5)
        assert waiting.closed

    asyncio.run(main())
