"""Continuous batching through the scheduler, driven pass by pass: requests arriving at random
rounds with random prompts, parameters, stop ids and cancellations, across bucket moves up and
down, some with prompts longer than the prefill budget (prefilled in chunks), decode exactly
what each decodes alone with the reference decoder (greedy, and seeded sampling with top-k
trees); cancelled requests keep a prefix of it; no slot is leaked."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.handle import FINISH_CANCELLED, EngineOverloadedError
from specrun.runtime.policies import CostPolicy
from specrun.runtime.reference import reference_generate
from specrun.runtime.scheduler import Scheduler
from specrun.runtime.tree import TreeShape
from tiny_models import ShuffledPolicy, targets_with_heads

# Depths differ per bucket, so slots moving between buckets carry more pending pairs than
# the shallower round makes.
TREES = {1: TreeShape(3, 2, 6), 2: TreeShape(2, 3, 5), 4: TreeShape(1, 2, 3)}
CONFIG = EngineConfig(device="cpu", buckets=(1, 2, 4), trees=TREES, max_seq_len=64, compile=False)


@pytest.fixture(scope="module")
def models():
    return targets_with_heads()


def _scheduler(target, head, **options) -> Scheduler:
    decoder = Decoder(target, head, CONFIG)
    fields = dict(tokenizer=None, max_waiting=64, max_prefill_tokens=12, threaded=False)
    return Scheduler(decoder, **(fields | options))


def _params(draw) -> SamplingParams:
    max_new = draw(st.integers(1, 12))
    stop = tuple(draw(st.lists(st.integers(1, 96), max_size=1)))
    kind = draw(st.sampled_from(["greedy", "sample", "top_p", "top_k"]))
    if kind == "greedy":
        return SamplingParams(max_new_tokens=max_new, stop_token_ids=stop)
    return SamplingParams(
        max_new_tokens=max_new,
        stop_token_ids=stop,
        temperature=draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_p=0.9 if kind == "top_p" else 1.0,
        top_k=5 if kind == "top_k" else 0,
        seed=draw(st.integers(0, 2**64 - 1)),
    )


@st.composite
def workloads(draw):
    """Requests: (prompt, params, arrival round, cancel round or None)."""
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        # Some prompts exceed the prefill budget (12 tokens) and are prefilled in chunks.
        long = draw(st.integers(0, 3)) == 0
        size = dict(min_size=13, max_size=30) if long else dict(min_size=1, max_size=9)
        prompt = draw(st.lists(st.integers(1, 96), **size))
        arrival = draw(st.integers(0, 8))
        cancel = draw(st.one_of(st.none(), st.integers(arrival, arrival + 6)))
        cancel = cancel if draw(st.integers(0, 4)) == 0 else None
        requests.append((prompt, _params(draw), arrival, cancel))
    return requests


def _run(scheduler: Scheduler, requests) -> list:
    handles = [None] * len(requests)
    for round_index in range(400):
        for index, (prompt, params, arrival, cancel) in enumerate(requests):
            if arrival == round_index:
                handles[index] = scheduler.submit(prompt, params)
            if cancel == round_index and handles[index] is not None:
                handles[index].cancel()
        busy = scheduler.step()
        if not busy and all(h is not None and h.done for h in handles):
            return handles
    raise AssertionError("the scheduler did not finish the requests in 400 passes")


def _check_against_reference(target, handles, requests) -> None:
    """Each request decoded what the reference decodes alone; a cancelled one a prefix."""
    for handle, (prompt, params, _, cancel) in zip(handles, requests, strict=True):
        [want] = reference_generate(target, [prompt], params)
        got = handle.result(timeout=0)
        if got.finish_reason == FINISH_CANCELLED:
            assert cancel is not None
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)


@pytest.mark.parametrize("kind", ["perfect", "eagle3", "plain"])
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=workloads())
def test_requests_decode_what_each_decodes_alone(models, kind, requests):
    target, head = models[kind]
    scheduler = _scheduler(target, head)
    with torch.no_grad():
        _check_against_reference(target, _run(scheduler, requests), requests)
    assert scheduler.slots == [None] * 4
    assert not scheduler._chunks
    assert bool(scheduler.decoder.state(4).done.all())
    stats = scheduler.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_requests == len(requests)


@pytest.mark.parametrize("kind", ["perfect", "eagle3"])
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=workloads(), seed=st.integers(0, 2**16))
def test_requests_prefilled_without_the_head_decode_what_each_decodes_alone(
    models, kind, requests, seed
):
    """Admissions the policy declines to draft (the head does not run over their prompts,
    their drafts empty), among drafted ones and under shapes changing every round, trees
    included: every request still decodes the reference's tokens."""
    target, head = models[kind]
    scheduler = _scheduler(target, head)
    policy = ShuffledPolicy(seed, leave_behind=0.2, undrafted=0.5)
    scheduler.decoder.planner.policy = policy
    with torch.no_grad():
        _check_against_reference(target, _run(scheduler, requests), requests)
    assert scheduler.slots == [None] * 4


def test_a_batch_grows_and_shrinks_across_buckets(models):
    """Four requests arrive together and finish at different rounds: the batch runs bucket
    4, then moves its live slots down into buckets 2 and 1."""
    target, head = models["perfect"]
    scheduler = _scheduler(target, head, max_prefill_tokens=100)
    lengths = [2, 30, 9, 20]
    prompts = [[1 + i, 2 + i] for i in range(4)]
    requests = [
        (prompt, SamplingParams(max_new_tokens=n), 0, None)
        for prompt, n in zip(prompts, lengths, strict=True)
    ]
    with torch.no_grad():
        handles = _run(scheduler, requests)
        for handle, (prompt, params, _, _) in zip(handles, requests, strict=True):
            [want] = reference_generate(target, [prompt], params)
            assert handle.result(timeout=0).token_ids == want.token_ids
    rounds = scheduler.stats().rounds_by_bucket
    assert {key.split(":")[0] for key in rounds} == {"1", "2", "4"}, rounds


def test_a_full_waiting_queue_refuses_and_later_requests_still_decode(models):
    target, head = models["perfect"]
    scheduler = _scheduler(target, head, max_waiting=2)
    params = SamplingParams(max_new_tokens=3)
    first = [scheduler.submit([5, 6], params) for _ in range(2)]
    with pytest.raises(EngineOverloadedError, match="max_waiting=2"):
        scheduler.submit([7], params)
    assert scheduler.stats().num_rejected == 1
    with torch.no_grad():
        while scheduler.step():
            pass
        later = scheduler.submit([7], params)
        while scheduler.step():
            pass
        [want] = reference_generate(target, [[5, 6]], params)
        assert [h.result(timeout=0).token_ids for h in first] == [want.token_ids] * 2
        assert (
            later.result(timeout=0).token_ids
            == reference_generate(target, [[7]], params)[0].token_ids
        )


def test_a_waiting_request_cancelled_never_runs(models):
    target, head = models["plain"]
    scheduler = _scheduler(target, head)
    handle = scheduler.submit([3, 4], SamplingParams(max_new_tokens=4))
    handle.cancel()
    assert handle.done and handle.result(timeout=0).finish_reason == FINISH_CANCELLED
    assert not scheduler.step()
    assert handle.result(timeout=0).token_ids == []


def test_a_cancel_and_an_admission_in_one_pass_reuse_the_slot_and_shrink(models):
    """A runs alone in slot 0 of bucket 1; B waits while A is cancelled: B is admitted into
    the freed slot; then C arrives while B runs and A' is cancelled, and the batch shrinks
    back to bucket 1 with C moved down."""
    target, head = models["perfect"]
    scheduler = _scheduler(target, head)
    params = SamplingParams(max_new_tokens=20)
    with torch.no_grad():
        first = scheduler.submit([1, 2], params)
        scheduler.step()
        second = scheduler.submit([3, 4], params)
        first.cancel()
        scheduler.step()
        assert scheduler.slots == [second, None, None, None]
        third = scheduler.submit([5, 6], params)
        scheduler.step()
        assert scheduler.slots[:2] == [second, third]
        second.cancel()
        scheduler.step()
        assert scheduler.slots == [third, None, None, None]
        while scheduler.step():
            pass
        [want] = reference_generate(target, [[5, 6]], params)
        assert third.result(timeout=0).token_ids == want.token_ids
        assert first.result(timeout=0).finish_reason == FINISH_CANCELLED


def test_static_batches_admit_only_into_an_idle_decoder(models):
    """Without continuous batching a request arriving while a batch runs waits until the
    batch's last request ends, and then decodes what it decodes alone."""
    target, head = models["perfect"]
    scheduler = _scheduler(target, head, continuous=False)
    short, long = SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=20)
    with torch.no_grad():
        first = [scheduler.submit([1, 2], short), scheduler.submit([3, 4], long)]
        scheduler.step()
        late = scheduler.submit([5, 6], short)
        while not first[1].done:
            assert late in scheduler._waiting and scheduler.step()
        while scheduler.step():
            pass
        for handle, prompt, params in zip(
            [*first, late], [[1, 2], [3, 4], [5, 6]], [short, long, short], strict=True
        ):
            [want] = reference_generate(target, [prompt], params)
            assert handle.result(timeout=0).token_ids == want.token_ids


class _RecordingCostPolicy(CostPolicy):
    """The cost policy, remembering the requests' remaining tokens it was shown each round."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int | None]] = []

    def choose(self, bucket, candidates, requests, costs):
        self.seen.append([r.remaining for r in requests])
        return super().choose(bucket, candidates, requests, costs)


@pytest.mark.parametrize("kind", ["eagle3", "plain"])
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=workloads())
def test_a_host_reading_a_round_late_decodes_the_same(models, kind, requests):
    """The host one round behind the device, as on CUDA (`Decoder.host_lag`): each round is
    planned before the last one's report is read, and still every request decodes what it
    decodes alone and every slot is freed."""
    target, head = models[kind]
    scheduler = _scheduler(target, head)
    scheduler.decoder.host_lag = 1
    with torch.no_grad():
        _check_against_reference(target, _run(scheduler, requests), requests)
    assert scheduler.slots == [None] * 4
    assert bool(scheduler.decoder.state(4).done.all())


def test_no_round_is_launched_for_requests_its_rounds_in_flight_end(models):
    """One round behind, a request with one token left and one round in flight ends with
    that round: the host launches no round after it, so N tokens take N - 1 rounds after
    the prefill's first token."""
    target, _ = models["plain"]
    scheduler = _scheduler(target, None)
    scheduler.decoder.host_lag = 1
    requests = [([3, 4, 5], SamplingParams(max_new_tokens=7, ignore_eos=True), 0, None)]
    with torch.no_grad():
        [handle] = _run(scheduler, requests)
    assert len(handle.result(timeout=0).token_ids) == 7
    assert scheduler.stats().num_rounds == 6


def test_a_result_is_delivered_after_its_work_is_counted(models):
    """When a request's last tokens reach its listener, the stats already count the request,
    its tokens and its rounds (a caller woken by the result reads them there); `wait_idle`
    runs the passes left."""
    target, head = models["eagle3"]
    scheduler = _scheduler(target, head)
    scheduler.decoder.host_lag = 1
    at_finish = []

    def listener(delta):
        if delta.finish_reason is not None:
            at_finish.append(scheduler.stats())

    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    handle = scheduler.submit([3, 4, 5], params, listener=listener)
    with torch.no_grad():
        assert scheduler.wait_idle()
    output = handle.result(timeout=0)
    [stats] = at_finish
    assert (stats.num_requests, stats.num_generated_tokens) == (1, 9)
    assert 0 < stats.num_rounds == output.stats.num_rounds == scheduler.stats().num_rounds
    assert scheduler.slots == [None] * 4


def test_the_policy_sees_remaining_tokens_only_while_nobody_waits(models):
    """Six requests for four slots: while two wait the policy maximises the batch's tokens
    per second (no remaining counts); once nobody waits it sees each request's remaining
    tokens, which only fall."""
    target, head = models["eagle3"]
    scheduler = _scheduler(target, head, max_prefill_tokens=100)
    policy = scheduler.decoder.planner.policy = _RecordingCostPolicy()
    requests = [([1 + i, 2], SamplingParams(max_new_tokens=10), 0, None) for i in range(6)]
    with torch.no_grad():
        _run(scheduler, requests)
    waiting = [seen for seen in policy.seen if None in seen]
    counted = [seen for seen in policy.seen if None not in seen]
    assert waiting and all(set(seen) == {None} for seen in waiting)
    assert counted and policy.seen.index(counted[0]) > policy.seen.index(waiting[-1])
    assert all(0 <= left <= 10 for seen in counted for left in seen)


def test_stats_count_the_plain_rounds_that_left_the_drafts_behind(models):
    """`num_rounds_drafts_behind` counts the bare plain rounds (neither appending nor
    committing pending pairs) of an engine with trees, not those that kept the drafts in
    step; an engine without a head counts none of its plain rounds."""
    target, head = models["perfect"]
    requests = [([3 + i, 4], SamplingParams(max_new_tokens=30), 0, None) for i in range(3)]
    scheduler = _scheduler(target, head)
    scheduler.decoder.planner.policy = ShuffledPolicy(1, leave_behind=0.5)
    plan, planned = scheduler.decoder.planner.plan, []
    scheduler.decoder.planner.plan = lambda *args: planned.append(plan(*args)) or planned[-1]
    with torch.no_grad():
        _run(scheduler, requests)
    plain = [v for v in planned if v.tree is None]
    bare = [v for v in plain if not v.appends and not v.num_pending]
    stats = scheduler.stats()
    assert stats.num_rounds == len(planned)
    assert 0 < stats.num_rounds_drafts_behind == len(bare) < len(plain), planned
    headless = _scheduler(target, None)
    with torch.no_grad():
        _run(headless, requests)
    assert headless.stats().num_rounds > 0 and headless.stats().num_rounds_drafts_behind == 0


def test_stats_count_the_rounds_the_policy_explored(models):
    """`num_rounds_exploring` counts the rounds the policy said it explored with, as planned
    (the flag travels with the round to its report)."""
    target, head = models["perfect"]
    requests = [([3 + i, 4], SamplingParams(max_new_tokens=20), 0, None) for i in range(3)]
    scheduler = _scheduler(target, head)
    planner = scheduler.decoder.planner
    planner.policy = ShuffledPolicy(2)
    flags = itertools.cycle([True, False, False])
    planner.policy.explored = lambda bucket: next(flags)
    plan, explored = planner.plan, []
    planner.plan = lambda *args: (plan(*args), explored.append(planner.explored))[0]
    with torch.no_grad():
        _run(scheduler, requests)
    stats = scheduler.stats()
    assert stats.num_rounds == len(explored)
    assert 0 < stats.num_rounds_exploring == sum(explored) < len(explored)
