"""Several async iterators read as one: a reply's choices, each an engine request of its own,
streamed as their chunks come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

Item = TypeVar("Item")


class _Ended:
    """What a reader leaves on the queue when its iterator ends (`error`: how it failed)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


async def merged(iterators: Sequence[AsyncIterator[Item]]) -> AsyncIterator[tuple[int, Item]]:
    """(index in `iterators`, item) for every item of every iterator, in the order they come:
    a task reads each iterator, so a slow one never holds back the others. An iterator's
    exception is raised as soon as it comes; whenever this ends (exhausted, failed, closed
    early or cancelled) every iterator is closed."""
    queue: asyncio.Queue[tuple[int, Item | _Ended]] = asyncio.Queue()

    async def read(index: int, iterator: AsyncIterator[Item]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
        except Exception as error:  # handed to the consumer, raised there
            queue.put_nowait((index, _Ended(error)))
        else:
            queue.put_nowait((index, _Ended()))

    tasks = [asyncio.create_task(read(i, it)) for i, it in enumerate(iterators)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if not isinstance(item, _Ended):
                yield index, item
            elif item.error is not None:
                raise item.error
            else:
                num_open -= 1
    finally:
        for task in tasks:
            task.cancel()
        # An iterator a task is still inside cannot be closed: the tasks end first.
        await asyncio.gather(*tasks, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()
