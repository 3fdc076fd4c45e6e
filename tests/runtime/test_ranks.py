"""The ranks a tensor-parallel engine starts (runtime/ranks.py `spawn_ranks`), on the CPU: a
started rank logs at rank 0's level with its rank on every line, and one that exits while
the ranks are open is logged as an error naming it and its exit code (rank 0 would
otherwise wait for it in a collective with nothing in the log); a started rank prints its
stacks on SIGUSR1; one whose work raises logs the error and exits at once, without waiting
to leave its groups."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time

from tensor_parallel_worker import exit_rank, failing_rank

from specrun.runtime.ranks import WATCH_SECONDS, spawn_ranks


def test_a_started_rank_logs_with_its_rank_prints_its_stacks_and_its_exit_is_logged(caplog, capfd):
    caplog.set_level(logging.INFO)
    ranks = spawn_ranks(
        2, device_type="cpu", entry=functools.partial(exit_rank, after=2.0), args=(3,)
    )
    try:
        if hasattr(signal, "SIGUSR1"):
            os.kill(ranks.workers[0].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 20 * WATCH_SECONDS
        while time.monotonic() < deadline and not _errors(caplog):
            time.sleep(0.1)
        assert any("specrun-rank1 exited with code 3" in m for m in _errors(caplog))
    finally:
        ranks.close()
    err = capfd.readouterr().err
    assert "rank 1: INFO specrun.tests: rank 1 leaving" in err
    assert "in _rank_main" in err or not hasattr(signal, "SIGUSR1")


def test_ranks_closed_normally_log_no_error(caplog):
    caplog.set_level(logging.INFO)
    ranks = spawn_ranks(2, device_type="cpu", entry=exit_rank, args=(0,))
    ranks.close()
    time.sleep(2 * WATCH_SECONDS)
    assert not _errors(caplog)


def test_a_started_rank_that_raises_logs_the_error_and_exits(caplog, capfd):
    caplog.set_level(logging.INFO)
    ranks = spawn_ranks(2, device_type="cpu", entry=failing_rank, args=("no such layer",))
    try:
        ranks.workers[0].join(30.0)
        assert ranks.workers[0].exitcode == 1
    finally:
        ranks.close()
    err = capfd.readouterr().err
    assert "rank 1: ERROR specrun.runtime.ranks: rank 1 failed; exiting" in err
    assert "RuntimeError: rank 1: no such layer" in err


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
