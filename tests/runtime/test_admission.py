"""runtime/admission.py: which chunks and waiting prompts one scheduler pass prefills within
its budget of prompt tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

from specrun.runtime.admission import take_prefills


@dataclass(eq=False)
class _Request:
    """What take_prefills reads of a RequestHandle (hashed by identity, as handles are)."""

    prompt_token_ids: list[int]


def _requests(*lengths: int) -> list[_Request]:
    return [_Request([1] * n) for n in lengths]


def _take(waiting, free, *, chunks=None, budget=10, continuous=True):
    queue = deque(waiting)
    prefills = take_prefills(queue, chunks or {}, free, budget=budget, continuous=continuous)
    return prefills, list(queue)


def test_waiting_prompts_fill_the_lowest_free_slots_in_order_while_the_budget_lasts():
    a, b, c, d = _requests(4, 5, 2, 1)
    prefills, left = _take([a, b, c, d], [5, 2, 3], budget=10)
    # c (2 tokens) would fit after a and b (9 of 10), but the order is kept: c waits, and d
    # behind it.
    assert prefills.whole == [(2, a), (3, b)] and left == [c, d]
    assert not prefills.chunks and not prefills.reserved and prefills


def test_the_first_whole_prompt_is_admitted_however_long_when_chunking_is_off():
    a, b = _requests(30, 1)
    prefills, left = _take([a, b], [0, 1], budget=10, continuous=False)
    assert prefills.whole == [(0, a)] and left == [b]


def test_a_long_prompt_reserves_its_slot_and_starts_a_chunk_of_what_is_left():
    a, b, c = _requests(3, 30, 1)
    prefills, left = _take([a, b, c], [0, 1, 2], budget=10)
    assert prefills.whole == [(0, a)] and prefills.reserved == [(1, b)]
    assert prefills.chunks == [(b, 7)] and left == [c]


def test_running_chunks_come_first_and_can_take_the_whole_budget():
    long, new = _requests(30, 2)
    chunks = {long: SimpleNamespace(num_remaining=12)}
    prefills, left = _take([new], [1], chunks=chunks, budget=10)
    assert prefills.chunks == [(long, 10)] and not prefills.whole and left == [new]
    chunks = {long: SimpleNamespace(num_remaining=4)}
    prefills, left = _take([new], [1], chunks=chunks, budget=10)
    assert prefills.chunks == [(long, 4)] and prefills.whole == [(1, new)] and not left


def test_nothing_is_taken_without_free_slots_or_requests():
    (a,) = _requests(3)
    prefills, left = _take([a], [])
    assert not prefills and left == [a]
    prefills, _ = _take([], [0, 1])
    assert not prefills
