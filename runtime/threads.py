"""Calls handed between threads: a call's outcome run on one thread and waited for on
another (the scheduler's loop runs posted calls between rounds), and a passing thread for
work whose thread-local state must not outlive it (OpenMP teams on the CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CallResult:
    """The outcome of a call run on the loop thread, waited for by its caller."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the caller's thread
            self._error = e
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def run_in_passing_thread(fn: Callable[[], Any]) -> Any:
    """fn() in a thread that ends when it returns; its value, or its exception re-raised.

    On the CPU, OpenMP keeps a team of worker threads for every thread that has run parallel
    ops, for as long as that thread lives. Once the teams hold more threads than there are
    cores, libgomp stops their workers spinning between parallel regions, and each GEMV of a
    decode step on the loop thread then waits for a sleeping worker to wake: with the model
    loaded on the caller's thread, the embedded model's plain step took 25-27 ms on two
    cores instead of 17-19. Loading in a passing thread takes its team with it.
    """
    result = CallResult()
    thread = threading.Thread(target=result.run, args=(fn,), name="specrun-load")
    thread.start()
    thread.join()
    return result.wait()
