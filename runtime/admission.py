"""Which prompt tokens one pass of the scheduler prefills: `take_prefills`.

Within a pass's budget of prompt tokens (`max_prefill_tokens`), first the next chunk of each
prompt being prefilled in chunks (oldest first), then waiting requests in FIFO order into
the lowest free slots while the budget lasts; a request that does not fit waits, and all
behind it. A prompt that fits the budget is admitted whole (the first one always, however
long). With continuous batching a longer one reserves its slot and starts a chunk of what is
left of the budget (runtime/chunked_prefill.py), so the running requests keep getting a
round every pass. The scheduler runs the result (runtime/scheduler.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .chunked_prefill import ChunkedPrefill
from .handle import RequestHandle


@dataclass
class Prefills:
    """One pass's prefills: chunks to run (request, most tokens), oldest first, among them
    the first chunks of the requests given reserved slots (slot, request); requests admitted
    whole (slot, request)."""

    chunks: list[tuple[RequestHandle, int]] = field(default_factory=list)
    reserved: list[tuple[int, RequestHandle]] = field(default_factory=list)
    whole: list[tuple[int, RequestHandle]] = field(default_factory=list)

    def __bool__(self) -> bool:
        """Whether the pass prefills anything."""
        return bool(self.chunks or self.whole)


def take_prefills(
    waiting: deque[RequestHandle],
    chunks: Mapping[RequestHandle, ChunkedPrefill],
    free_slots: Sequence[int],
    *,
    budget: int,
    continuous: bool,
) -> Prefills:
    """This pass's prefills within `budget` prompt tokens: the next chunk of each chunking
    request (`chunks`, oldest first), then requests popped from the front of `waiting` into
    the lowest of `free_slots` (none: no admission this pass), whole or (longer than the
    budget, `continuous` only) reserved for chunks; the first whole one always."""
    prefills = Prefills()
    max_tokens = budget
    for handle, chunked in chunks.items():
        num_tokens = min(budget, chunked.num_remaining)
        if num_tokens:
            prefills.chunks.append((handle, num_tokens))
            budget -= num_tokens
    free = sorted(free_slots)
    while waiting and free:
        length = len(waiting[0].prompt_token_ids)
        if continuous and length > max_tokens:
            if not budget:
                break
            handle = waiting.popleft()
            prefills.reserved.append((free.pop(0), handle))
            prefills.chunks.append((handle, budget))
            budget = 0
        elif length <= budget or not prefills:
            prefills.whole.append((free.pop(0), waiting.popleft()))
            budget = max(0, budget - length)
        else:
            break
    return prefills
