"""Soak test of `specrun serve`: hundreds of random requests over HTTP at bounded concurrency
(completions and chat, streamed or not, prompts of a few to a few hundred tokens, greedy or
seeded sampling with top-p/top-k, stop strings), a tenth of them abandoned by their client
mid-stream. Checks every answer, that each disconnect cancels its request and nothing is left
running, that no slot leaks, that the server's memory stays flat after a warm-up and that its
log holds no traceback.

The server runs a tiny random Llama over a byte-level vocabulary with a random EAGLE-3 head
(tiny_models.save_byte_level_chat_model), not the embedded model: on a 2-core CI CPU a round
of the embedded model's bucket 16 takes about 0.4 s, the tiny model's about 20 ms, so the
soak exercises the server, scheduler and speculative rounds rather than matrix products.
Random bytes out also stress the streamed UTF-8 decoding.

SPECRUN_SOAK_REQUESTS sets the number of requests after the warm-up (default 500), e.g.
`SPECRUN_SOAK_REQUESTS=5000 pytest tests/server/test_soak.py` for a longer run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from http_server import MODEL_NAME, Server, start_server
from tiny_models import save_byte_level_chat_model

NUM_REQUESTS = int(os.environ.get("SPECRUN_SOAK_REQUESTS", "500"))
NUM_WARMUP_REQUESTS = 60
NUM_TWINS = 8
CONCURRENCY = 16
MAX_BUCKET = 16
ABANDONED_SHARE = 0.1
# Long enough that a client leaving after a few events nearly always leaves before the end
# (rounds whose tokens decode to no text, such as skipped special tokens, send no event, so
# a request that samples little text can end within a few).
LONG_MAX_TOKENS = 256
RSS_TOLERANCE = 0.05

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "café",
         "naïve", "Grüße", "東京", "🙂", "and", "then", "of", "42", "x", "\n")  # fmt: skip
# The random model's bytes often decode to U+FFFD, so stop strings that include it end many
# requests; the others end a few.
STOPS = ("\ufffd", "e", "a", "o ", "th", "\n", "é", "!", "-")


@dataclass
class Call:
    """One request: its route under /v1, its JSON body, and for an abandoned stream the
    number of server-sent events its client reads before it disconnects."""

    route: str
    body: dict
    leave_after: int | None = None


@dataclass
class Answer:
    """What the client saw: the text, the finish reason (None: it left before), usage."""

    text: str
    finish_reason: str | None
    usage: dict | None = None


@dataclass
class SoakRun:
    """The soak's calls and answers, /metrics around it, the server's RSS (KiB)."""

    calls: list[Call]
    answers: list[Answer]
    twins: list[tuple[int, int]]
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    rss_kib: dict[str, int] = field(default_factory=dict)

    def delta(self, name: str) -> float:
        return self.metrics_after[name] - self.metrics_before[name]


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    model_dir, head_dir = save_byte_level_chat_model(
        tmp_path_factory.mktemp("byte-level-model"), chat_config_dir=smollm_dir
    )
    # One thread: the tiny model's matrices are too small to split. A fixed mmap threshold
    # turns glibc's adaptive one off, whose trim threshold (up to 64 MiB) kept as much freed
    # heap in the idle RSS as the last rounds left at the top: it swung by +-7%, hiding leaks.
    server = start_server(
        model_dir, tmp_path_factory,
        "--draft", str(head_dir), "--buckets", "1", "2", "4", "8", str(MAX_BUCKET),
        "--max-seq-len", "1024", "--max-waiting", "64",
        threads=1, env={"MALLOC_MMAP_THRESHOLD_": str(16 * 2**20)},
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def soak(server) -> SoakRun:
    rng = random.Random(20261124)
    warmup, _ = plan(rng, NUM_WARMUP_REQUESTS)
    run_phase(server, warmup)
    rss_warm = rss_kib(server)
    calls, twins = plan(rng, NUM_REQUESTS)
    answers, before, after = run_phase(server, calls)
    rss = {"after_warmup": rss_warm, "after_soak": rss_kib(server)}
    return SoakRun(calls, answers, twins, before, after, rss)


def run_phase(server: Server, calls: list[Call]) -> tuple[list[Answer], dict, dict]:
    """Send the calls; once every one ended: (answers, /metrics before, /metrics after)."""
    before = server.metrics()
    answers = asyncio.run(send_all(server, calls))
    expected = before["specrun_requests_finished_total"] + len(calls)
    return answers, before, settle(server, expected_finished=expected)


def plan(rng: random.Random, count: int) -> tuple[list[Call], list[tuple[int, int]]]:
    """`count` random calls, a tenth abandoned, plus NUM_TWINS of the kept ones sent again
    later with streaming flipped: the calls and the (first, repeat) index pairs."""
    calls = [random_call(rng) for _ in range(count)]
    for index in rng.sample(range(count), round(count * ABANDONED_SHARE)):
        calls[index] = abandoned(calls[index], rng)
    kept = [i for i, call in enumerate(calls) if call.leave_after is None]
    pairs = []
    for index in rng.sample(kept, min(NUM_TWINS, len(kept))):
        calls[index], repeat = twins_of(calls[index])
        pairs.append((calls[index], repeat))
    for first, repeat in pairs:
        start = next(i for i, call in enumerate(calls) if call is first)
        calls.insert(rng.randint(start + 1, len(calls)), repeat)
    position = {id(call): index for index, call in enumerate(calls)}
    return calls, [(position[id(first)], position[id(repeat)]) for first, repeat in pairs]


def random_call(rng: random.Random) -> Call:
    chat = rng.random() < 0.4
    text = random_text(rng)
    body = {
        "model": MODEL_NAME,
        "max_tokens": rng.randint(1, 24),
        "temperature": 0.0 if rng.random() < 0.4 else round(rng.uniform(0.7, 1.3), 2),
        "seed": rng.randrange(2**32),
        "stream": rng.random() < 0.5,
    }
    body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    if rng.random() < 0.25:
        body["top_p"] = round(rng.uniform(0.5, 0.95), 2)
    if rng.random() < 0.25:
        body["top_k"] = rng.randint(1, 40)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if body["stream"] and rng.random() < 0.7:
        body["stream_options"] = {"include_usage": True}
    return Call("chat/completions" if chat else "completions", body)


def random_text(rng: random.Random) -> str:
    """Words up to 8 to 300 characters (the byte-level model's tokens are bytes)."""
    size = int(2 ** rng.uniform(3, 8.2))
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def abandoned(call: Call, rng: random.Random) -> Call:
    """A stream its client leaves after 1 to 3 events; half of them too long to end first."""
    body = {k: v for k, v in call.body.items() if k != "stop"} | {"stream": True}
    body["ignore_eos"] = True
    if rng.random() < 0.5:
        body["max_tokens"] = LONG_MAX_TOKENS
    return Call(call.route, body, leave_after=rng.randint(1, 3))


def twins_of(call: Call) -> tuple[Call, Call]:
    """The seeded request streamed and not, both reporting usage."""
    body = call.body | {"stream_options": {"include_usage": True}}
    return Call(call.route, body), Call(call.route, body | {"stream": not body["stream"]})


async def send_all(server: Server, calls: list[Call]) -> list[Answer]:
    """Every call, at most CONCURRENCY at a time; answers in call order."""
    semaphore = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=f"{server.url}/v1", timeout=60, limits=limits) as client:

        async def send_one(call: Call) -> Answer:
            async with semaphore:
                return await send(client, call)

        return await asyncio.gather(*(send_one(call) for call in calls))


async def send(client: httpx.AsyncClient, call: Call) -> Answer:
    if not call.body["stream"]:
        reply = await client.post(f"/{call.route}", json=call.body)
        assert reply.status_code == 200, reply.text
        return whole_answer(reply.json(), chat=call.route != "completions")
    events = []
    async with client.stream("POST", f"/{call.route}", json=call.body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line.removeprefix("data: "))
            if len(events) == call.leave_after:
                break  # leaving the block closes the connection mid-stream
    return streamed_answer(events, chat=call.route != "completions", left=call.leave_after)


def whole_answer(body: dict, *, chat: bool) -> Answer:
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    [choice] = body["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    if chat:
        assert choice["message"]["role"] == "assistant"
    return Answer(text, choice["finish_reason"], body["usage"])


def streamed_answer(events: list[str], *, chat: bool, left: int | None) -> Answer:
    """The answer of an SSE stream, checked: one id, one finish reason on the last choice,
    the usage chunk (when asked for) just before [DONE]."""
    if left is None:
        assert events[-1] == "[DONE]", events[-3:]
        events = events[:-1]
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    assert len({chunk["id"] for chunk in chunks}) <= 1
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(chunk["object"] == kind for chunk in chunks)
    usage = chunks.pop()["usage"] if chunks and "usage" in chunks[-1] else None
    choices = [chunk["choices"][0] for chunk in chunks]
    if chat and choices:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    reasons = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert len(reasons) <= 1 and (not reasons or choices[-1]["finish_reason"] == reasons[0])
    if left is None:
        assert len(reasons) == 1, choices[-3:]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
    return Answer(text, reasons[0] if reasons else None, usage)


def settle(server: Server, *, expected_finished: float | None = None) -> dict[str, float]:
    """/metrics once every request ended (the finished counter reached `expected_finished`)
    and nothing runs or waits."""
    deadline = time.monotonic() + 10
    while expected_finished is not None:
        if server.metric("specrun_requests_finished_total") >= expected_finished:
            break
        assert time.monotonic() < deadline, "requests never ended"
        time.sleep(0.02)
    server.wait_idle()
    return server.metrics()


def rss_kib(server: Server) -> int:
    with open(f"/proc/{server.process.pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


def test_every_kept_request_ends_with_a_valid_answer(soak):
    for call, answer in zip(soak.calls, soak.answers, strict=True):
        if call.leave_after is not None:
            continue
        body, usage = call.body, answer.usage
        assert answer.finish_reason in {"stop", "length"}, (body, answer)
        for stop in body.get("stop", ()):
            assert stop not in answer.text, (body, answer)
        if usage is None:
            assert body["stream"] and not body.get("stream_options")
            continue
        assert 0 < usage["completion_tokens"] <= body["max_tokens"], (body, answer)
        assert usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if answer.finish_reason == "length":
            assert usage["completion_tokens"] == body["max_tokens"], (body, answer)


def test_streamed_and_whole_repeats_of_a_seeded_request_agree(soak):
    assert len(soak.twins) == NUM_TWINS
    for first, repeat in soak.twins:
        one, other = soak.answers[first], soak.answers[repeat]
        assert soak.calls[first].body["stream"] != soak.calls[repeat].body["stream"]
        assert (one.text, one.finish_reason) == (other.text, other.finish_reason)
        if "stop" not in soak.calls[first].body:
            assert one.usage == other.usage


def test_disconnects_cancel_their_requests_and_nothing_is_left(soak):
    left = [(c, a) for c, a in zip(soak.calls, soak.answers, strict=True) if c.leave_after]
    assert len(left) == round(NUM_REQUESTS * ABANDONED_SHARE)
    long = [a for c, a in left if c.body["max_tokens"] == LONG_MAX_TOKENS]
    # Such a request ends only by its length (ignore_eos, no stop strings); one whose client
    # left before its end was cancelled.
    assert all(answer.finish_reason in (None, "length") for answer in long)
    surely_cancelled = [answer for answer in long if answer.finish_reason is None]
    assert len(surely_cancelled) >= len(long) // 2, long
    # A stop string found ends its request by cancelling it too.
    num_stopped = sum(
        "stop" in call.body and answer.finish_reason == "stop"
        for call, answer in zip(soak.calls, soak.answers, strict=True)
    )
    cancelled = soak.delta("specrun_requests_cancelled_total")
    assert len(surely_cancelled) <= cancelled <= len(left) + num_stopped
    assert soak.delta("specrun_requests_finished_total") == len(soak.calls)
    assert soak.delta("specrun_requests_rejected_total") == 0
    assert soak.metrics_after["specrun_requests_running"] == 0
    assert soak.metrics_after["specrun_requests_waiting"] == 0


def test_memory_is_flat_after_the_warmup(soak):
    warm, end = soak.rss_kib["after_warmup"], soak.rss_kib["after_soak"]
    print(f"server RSS: {warm} KiB after the warm-up, {end} KiB after the soak")
    assert abs(end - warm) <= RSS_TOLERANCE * warm, soak.rss_kib


def test_a_full_bucket_runs_at_once_after_the_soak(soak, server):
    """Were a slot leaked, one of MAX_BUCKET long streams would wait for another to end, and
    /metrics would never show all of them running. (Not judged by when each stream's first
    event comes: rounds whose tokens decode to no text send none, so a stream of the random
    byte-level model may stay silent for most of its tokens.)"""

    async def stream(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL_NAME, "prompt": "the fox", "max_tokens": 128, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with client.stream("POST", "/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"]:
                    return
        raise AssertionError("a stream ended without its finish reason")

    async def most_running(streams: asyncio.Future) -> float:
        most = 0.0
        while not streams.done():
            running = await asyncio.to_thread(server.metric, "specrun_requests_running")
            most = max(most, running)
            await asyncio.sleep(0.01)
        return most

    async def full_bucket() -> float:
        limits = httpx.Limits(max_connections=MAX_BUCKET)
        async with httpx.AsyncClient(base_url=f"{server.url}/v1", timeout=60, limits=limits) as c:
            streams = asyncio.gather(*(stream(c) for _ in range(MAX_BUCKET)))
            most = await most_running(streams)
            await streams
            return most

    assert asyncio.run(full_bucket()) == MAX_BUCKET
    settle(server)


def test_the_server_log_has_no_traceback(soak, server):
    log = server.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]
