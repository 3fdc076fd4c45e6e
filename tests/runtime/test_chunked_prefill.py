"""Chunked prefill of prompts longer than the scheduler's prefill budget: the staging state
after the chunks is what one whole prefill leaves; a chunked request decodes exactly what it
decodes alone with the reference decoder (greedy and seeded sampling, plain decoding and two
draft heads); the requests already running get a round every pass while it is chunked;
waiting requests behind it are admitted when a pass leaves budget; cancelling it or closing
the scheduler frees its reserved slot."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specrun.runtime.chunked_prefill import ChunkedPrefill
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.handle import FINISH_CANCELLED
from specrun.runtime.prefill import allocate_state, prefill
from specrun.runtime.reference import reference_generate
from specrun.runtime.scheduler import Scheduler
from specrun.runtime.tree import TreeShape
from tiny_models import targets_with_heads

TREES = {1: TreeShape(3, 2, 6), 2: TreeShape(2, 3, 5), 4: TreeShape(1, 2, 3)}
CONFIG = EngineConfig(device="cpu", buckets=(1, 2, 4), trees=TREES, max_seq_len=64, compile=False)
LONG_PROMPT = [(7 * i) % 96 + 1 for i in range(30)]
GREEDY = SamplingParams(max_new_tokens=10)
SEEDED = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=5, seed=2**40 + 7)


@pytest.fixture(scope="module")
def models():
    return targets_with_heads()


def _scheduler(target, head, *, max_prefill_tokens: int, continuous: bool = True) -> Scheduler:
    return Scheduler(
        Decoder(target, head, CONFIG),
        tokenizer=None,
        max_waiting=16,
        max_prefill_tokens=max_prefill_tokens,
        continuous=continuous,
        threaded=False,
    )


def _finish(scheduler: Scheduler) -> None:
    for _ in range(200):
        if not scheduler.step():
            return
    raise AssertionError("the scheduler did not finish in 200 passes")


def _alone(target, prompt, params) -> list[int]:
    return reference_generate(target, [prompt], params)[0].token_ids


@pytest.mark.parametrize("max_rows", [None, 16, 512], ids=["unpadded", "pieces", "padded"])
@pytest.mark.parametrize("kind", ["plain", "perfect", "eagle3"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 29, 30])
def test_the_staging_state_after_the_chunks_is_a_whole_prefills(models, kind, chunk, max_rows):
    """Padded chunks, whole or in pieces of at most max_rows tokens (as on the CPU), too:
    their padding rows leave no trace in the state."""
    target, head = models[kind]
    chunked = ChunkedPrefill(
        target, head, LONG_PROMPT, SEEDED, eos_token_ids=(), depth=3, max_rows=max_rows
    )
    whole = allocate_state(target, head, batch_size=1, capacity=len(LONG_PROMPT), depth=3)
    with torch.no_grad():
        reports = [chunked.run(chunk)]
        while not chunked.finished:
            reports.append(chunked.run(chunk))
        want = prefill(target, head, whole, [LONG_PROMPT], [SEEDED], eos_token_ids=())
    assert len(reports) == -(-len(LONG_PROMPT) // chunk)
    assert all(report.shape == (0, 7) for report in reports[:-1])
    assert torch.equal(reports[-1], want)
    for name, got, expected in _named_tensors(chunked.staging, whole):
        assert got.dtype == expected.dtype, name
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=name)


def _named_tensors(state, other, prefix=""):
    """(name, tensor of `state`, tensor of `other`) for every tensor field, recursively."""
    for f in dataclasses.fields(state):
        value, other_value = getattr(state, f.name), getattr(other, f.name)
        if isinstance(value, torch.Tensor):
            yield prefix + f.name, value, other_value
        elif dataclasses.is_dataclass(value):
            yield from _named_tensors(value, other_value, f"{prefix}{f.name}.")


@pytest.mark.parametrize("kind", ["plain", "perfect", "eagle3"])
@pytest.mark.parametrize("max_prefill_tokens", [4, 7, 12])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_chunked_prompt_decodes_what_it_decodes_alone(models, kind, max_prefill_tokens, params):
    """A runs; B, longer than the budget, arrives and is chunked; C arrives behind it."""
    target, head = models[kind]
    scheduler = _scheduler(target, head, max_prefill_tokens=max_prefill_tokens)
    running = ([5, 6], SamplingParams(max_new_tokens=20, temperature=0.8, seed=3))
    behind = ([9, 8, 7], GREEDY)
    with torch.no_grad():
        first = scheduler.submit(*running)
        scheduler.step()
        long = scheduler.submit(LONG_PROMPT, params)
        scheduler.step()
        assert long in scheduler.slots and not long.token_ids
        last = scheduler.submit(*behind)
        _finish(scheduler)
        for handle, (prompt, p) in zip(
            [first, long, last], [running, (LONG_PROMPT, params), behind], strict=True
        ):
            assert handle.result(timeout=0).token_ids == _alone(target, prompt, p)
    assert scheduler.slots == [None] * 4


@pytest.mark.parametrize("kind", ["plain", "perfect"])
def test_running_requests_get_a_round_every_pass_while_a_prompt_is_chunked(models, kind):
    target, head = models[kind]
    scheduler = _scheduler(target, head, max_prefill_tokens=4)
    running = scheduler.submit([5, 6], SamplingParams(max_new_tokens=40))
    with torch.no_grad():
        scheduler.step()
        long = scheduler.submit(LONG_PROMPT, GREEDY)
        num_chunks = -(-len(LONG_PROMPT) // 4)
        for _ in range(num_chunks - 1):
            num_tokens = len(running.token_ids)
            prefill_seconds = scheduler.stats().prefill_seconds
            scheduler.step()
            assert scheduler.slots[:2] == [running, long]
            assert len(running.token_ids) > num_tokens
            assert scheduler.stats().prefill_seconds > prefill_seconds
            assert not long.token_ids and long.stats.num_rounds == 0
        scheduler.step()  # the last chunk (the root token), then its first round
        assert long.stats.num_rounds == 1 and not running.done
        _finish(scheduler)
        assert long.result(timeout=0).token_ids == _alone(target, LONG_PROMPT, GREEDY)
        want = _alone(target, [5, 6], SamplingParams(max_new_tokens=40))
        assert running.result(timeout=0).token_ids == want


def test_a_waiting_request_behind_a_chunked_one_is_admitted_when_a_pass_leaves_budget(models):
    """Budget 12, prompt 30: chunks of 12, 12 and 6; the 4-token request behind it waits
    for the pass of the 6-token chunk."""
    target, head = models["perfect"]
    scheduler = _scheduler(target, head, max_prefill_tokens=12)
    with torch.no_grad():
        long = scheduler.submit(LONG_PROMPT, GREEDY)
        short = scheduler.submit([1, 2, 3, 4], GREEDY)
        for _ in range(2):
            scheduler.step()
            assert scheduler.slots == [long, None, None, None]
        scheduler.step()
        assert scheduler.slots == [long, short, None, None]
        _finish(scheduler)
        assert long.result(timeout=0).token_ids == _alone(target, LONG_PROMPT, GREEDY)
        assert short.result(timeout=0).token_ids == _alone(target, [1, 2, 3, 4], GREEDY)


def test_a_reserved_slot_moved_down_receives_its_prompt(models):
    """A and B run in slots 0 and 1, C is chunked into slot 2 (bucket 4); A and B are
    cancelled, so the batch shrinks to bucket 1 and C's reservation moves to slot 0, where
    its last chunk installs it."""
    target, head = models["eagle3"]
    scheduler = _scheduler(target, head, max_prefill_tokens=4)
    params = SamplingParams(max_new_tokens=30)
    with torch.no_grad():
        first, second = scheduler.submit([1, 2], params), scheduler.submit([3], params)
        scheduler.step()
        chunked = scheduler.submit(LONG_PROMPT, SEEDED)
        scheduler.step()
        assert scheduler.slots == [first, second, chunked, None]
        first.cancel()
        second.cancel()
        scheduler.step()
        assert scheduler.slots == [chunked, None, None, None] and not chunked.token_ids
        _finish(scheduler)
        assert chunked.result(timeout=0).token_ids == _alone(target, LONG_PROMPT, SEEDED)


def test_cancelling_a_chunked_request_frees_its_slot(models):
    target, head = models["eagle3"]
    scheduler = _scheduler(target, head, max_prefill_tokens=4)
    with torch.no_grad():
        long = scheduler.submit(LONG_PROMPT, GREEDY)
        scheduler.step()
        scheduler.step()
        assert scheduler.slots[0] is long
        long.cancel()
        scheduler.step()
        assert scheduler.slots == [None] * 4 and not scheduler.step()
        assert long.result(timeout=0).finish_reason == FINISH_CANCELLED
        assert long.token_ids == []
        later = scheduler.submit([3, 4], GREEDY)
        _finish(scheduler)
        assert later.result(timeout=0).token_ids == _alone(target, [3, 4], GREEDY)
    assert scheduler.stats().num_cancelled == 1


def test_closing_the_scheduler_cancels_a_chunked_request(models):
    target, head = models["plain"]
    scheduler = _scheduler(target, head, max_prefill_tokens=4)
    with torch.no_grad():
        running = scheduler.submit([5, 6], SamplingParams(max_new_tokens=40))
        scheduler.step()
        long = scheduler.submit(LONG_PROMPT, GREEDY)
        scheduler.step()
        scheduler.close()
        _finish(scheduler)
    assert scheduler.slots == [None] * 4
    assert [h.result(timeout=0).finish_reason for h in (running, long)] == [FINISH_CANCELLED] * 2
    assert long.token_ids == []


def test_static_batches_prefill_long_prompts_whole(models):
    target, head = models["perfect"]
    scheduler = _scheduler(target, head, max_prefill_tokens=4, continuous=False)
    with torch.no_grad():
        long = scheduler.submit(LONG_PROMPT, SEEDED)
        scheduler.step()
        assert len(long.token_ids) >= 1
        _finish(scheduler)
        assert long.result(timeout=0).token_ids == _alone(target, LONG_PROMPT, SEEDED)
