"""One Engine used from many threads and from asyncio: every request decodes what it decodes
alone, streams interleave freely, cancellation frees slots, the caller's RNG is untouched, and
a closed engine refuses work."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

from specrun.runtime import Engine, EngineClosedError, EngineConfig, SamplingParams
from specrun.runtime.async_engine import AsyncEngine
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft

CONFIG = EngineConfig(
    device="cpu",
    dtype="float32",
    buckets=(1, 2, 4),
    trees={1: TreeShape(3, 3, 8), 2: TreeShape(2, 3, 6), 4: TreeShape(2, 2, 4)},
    max_seq_len=256,
)
PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about rain.",
    "Count from one to five.",
    [1, 2, 3, 4],
    "What is two plus two?",
    "Say something kind.",
    "Describe a cat in one sentence.",
]


def _params(index: int) -> SamplingParams:
    if index % 2:
        return SamplingParams(max_new_tokens=10 + index, temperature=0.9, seed=100 + index)
    return SamplingParams(max_new_tokens=10 + index)


@pytest.fixture(scope="module")
def engine(smollm_dir) -> Engine:
    plain = Engine.from_pretrained(smollm_dir, config=CONFIG)
    spec = Engine(plain.model, plain.tokenizer, CONFIG, head=TargetAsDraft(plain.model))
    yield spec
    spec.close()


@pytest.fixture(scope="module")
def alone(engine) -> list[str]:
    return [engine.generate(p, _params(i))[0].text for i, p in enumerate(PROMPTS)]


def test_eight_threads_mixing_generate_and_stream_decode_what_each_decodes_alone(engine, alone):
    got: dict[int, str] = {}

    def work(index: int) -> None:
        prompt, params = PROMPTS[index], _params(index)
        if index % 3 == 0:
            got[index] = "".join(engine.stream(prompt, params))
        else:
            got[index] = engine.generate(prompt, params)[0].text

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [got.get(i) for i in range(len(PROMPTS))] == alone


def test_streams_advanced_in_turn_and_a_generate_between_them(engine, alone):
    streams = [engine.stream(PROMPTS[i], _params(i)) for i in (0, 1)]
    texts = ["", ""]
    torch.manual_seed(7)
    want_rand = torch.rand(4)
    torch.manual_seed(7)
    pending = [True, True]
    while any(pending):
        for k, stream in enumerate(streams):
            if pending[k]:
                try:
                    texts[k] += next(stream)
                except StopIteration:
                    pending[k] = False
        assert engine.generate(PROMPTS[2], _params(2))[0].text == alone[2]
    assert texts == alone[:2]
    assert torch.equal(torch.rand(4), want_rand)  # the engine never drew from it


def test_a_closed_stream_cancels_its_request_and_frees_its_slot(engine):
    stream = engine.stream(PROMPTS[0], SamplingParams(max_new_tokens=150, ignore_eos=True))
    next(stream)
    stream.close()
    assert engine.wait_idle(timeout=10) and engine.stats().num_running == 0
    handle = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=150, ignore_eos=True))
    next(iter(handle))
    handle.cancel()
    output = handle.result(timeout=30)
    assert output.finish_reason == "cancelled" and 0 < len(output.token_ids) < 150
    assert engine.wait_idle(timeout=10) and engine.stats().num_running == 0


def test_wait_idle_times_out_while_a_request_decodes_and_returns_once_none_does(engine):
    handle = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=150, ignore_eos=True))
    next(iter(handle))
    assert not engine.wait_idle(timeout=0.05)
    handle.cancel()
    assert engine.wait_idle(timeout=30)
    idle = engine.stats()
    time.sleep(0.05)
    # No active period is open: the decoding time stands still.
    assert idle.num_running == 0 and engine.stats().decode_seconds == idle.decode_seconds


def test_asyncio_generate_stream_and_cancellation(engine, alone):
    async_engine = AsyncEngine(engine)

    async def main():
        streamed = async_engine.stream(PROMPTS[3], _params(3))
        texts = await asyncio.gather(
            async_engine.generate(PROMPTS[0], _params(0)),
            async_engine.generate(PROMPTS[1], _params(1)),
            _join(streamed),
        )
        long = SamplingParams(max_new_tokens=150, ignore_eos=True)
        task = asyncio.create_task(async_engine.generate(PROMPTS[4], long))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await async_engine.wait_idle(timeout=30)
        return texts

    [first], [second], third = asyncio.run(main())
    assert [first.text, second.text, third] == [alone[0], alone[1], alone[3]]
    assert engine.stats().num_running == 0


async def _join(stream) -> str:
    return "".join([delta async for delta in stream])


def test_a_list_is_admitted_as_one_batch_and_a_longer_one_waits_for_room(
    engine, alone, monkeypatch
):
    """`generate` queues its prompts together: the loop prefills the four in one batch, even
    when it gets to run between two single submissions (here each is followed by a pause),
    not the first alone while the rest are queued; eight prompts with room for two waiting
    still decode what each decodes alone."""
    sizes = []
    prefill_batch = engine.decoder.prefill_batch
    submit = engine._scheduler.submit

    def recorded(bucket, prompts, params, **options):
        sizes.append(sum(p.max_new_tokens > 0 for p in params))
        return prefill_batch(bucket, prompts, params, **options)

    def submit_then_pause(*args, **kwargs):
        handle = submit(*args, **kwargs)
        time.sleep(0.2)
        return handle

    monkeypatch.setattr(engine._scheduler, "submit", submit_then_pause)
    engine.decoder.prefill_batch = recorded
    try:
        outputs = engine.generate(PROMPTS[:4], [_params(i) for i in range(4)])
        assert [o.text for o in outputs] == alone[:4]
        assert sizes == [4]
    finally:
        del engine.decoder.prefill_batch
    few_waiting = Engine(engine.model, engine.tokenizer, dataclasses.replace(CONFIG, max_waiting=2))
    try:
        outputs = few_waiting.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
        assert [o.text for o in outputs] == alone
    finally:
        few_waiting.close()


def test_a_closed_engine_refuses_requests(smollm_dir):
    engine = Engine.from_pretrained(smollm_dir, config=CONFIG)
    handle = engine.submit("Hello", SamplingParams(max_new_tokens=150, ignore_eos=True))
    engine.close()
    assert handle.result(timeout=30).finish_reason in ("cancelled", "length")
    with pytest.raises(EngineClosedError, match="closed"):
        engine._scheduler.submit([1, 2], SamplingParams())


def test_cpu_loading_runs_off_the_callers_thread_and_its_errors_come_back(smollm_dir, monkeypatch):
    """from_pretrained on the CPU loads in a thread that ends with the loading (the caller's
    thread keeps no OpenMP team beside the loop thread's: threads.run_in_passing_thread);
    what loading raises reaches the caller unchanged."""
    from specrun.runtime import engine as engine_module

    loaded_on: list[threading.Thread] = []
    real_load = engine_module.load_target

    def recording_load(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_target", recording_load)
    engine = Engine.from_pretrained(smollm_dir, config=CONFIG)
    try:
        assert engine.generate("Name three colours.", SamplingParams(max_new_tokens=4))[0].text
    finally:
        engine.close()
    assert len(loaded_on) == 1 and loaded_on[0] is not threading.current_thread()
    assert not loaded_on[0].is_alive()

    def failing_load(*args, **kwargs):
        raise ValueError("no weights here")

    monkeypatch.setattr(engine_module, "load_target", failing_load)
    with pytest.raises(ValueError, match="no weights here"):
        Engine.from_pretrained(smollm_dir, config=CONFIG)
