"""`specrun serve` through the real `openai` client and raw HTTP: completions and chat
completions, streamed and not, stop strings cut exactly, seeds reproduce, n choices each
seeded apart, several prompts per completion, bad requests get a 400 naming the field, a
client that disconnects mid-stream frees its requests."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specrun.server.protocol import CompletionRequest

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completions_streamed_and_not_agree(server, client):
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    [choice] = whole.choices
    assert text == choice.text and choice.text.strip()
    assert choice.finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert whole.usage.completion_tokens == 12 == chunks[-1].usage.completion_tokens
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0


def test_metrics_give_each_round_run_its_policy_cost(server, client):
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    samples = server.metrics()
    rounds = [name for name in samples if name.startswith("specrun_rounds_total{")]
    assert rounds
    for name in rounds:
        labels = name.removeprefix("specrun_rounds_total")
        assert samples[f"specrun_round_cost_milliseconds{labels}"] > 0
    assert 0 <= samples["specrun_rounds_drafts_behind_total"] <= sum(samples[n] for n in rounds)
    assert 0 <= samples["specrun_rounds_exploring_total"] <= sum(samples[n] for n in rounds)


def test_chat_completions_streamed_and_not(client):
    whole = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=30, temperature=0
    )
    assert "Paris" in whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=30, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == whole.choices[0].message.content


def test_stop_strings_cut_exactly_streamed_and_not(client):
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.index(stop)]
    cut = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (want, "stop")
    stream = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeds_reproduce_and_sampling_varies(client):
    def sample(seed):
        return (
            client.completions.create(
                model="smollm2", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1


def test_choice_i_samples_from_seed_plus_i():
    body = CompletionRequest(prompt="hi", n=3, seed=7)
    seeds = [body.sampling_params(max_tokens=4, choice=i).seed for i in range(3)]
    assert seeds == [7, 8, 9]
    last = CompletionRequest(prompt="hi", n=2, seed=2**64 - 1)
    assert last.sampling_params(max_tokens=4, choice=1).seed == 0
    assert CompletionRequest(prompt="hi", n=2).sampling_params(max_tokens=4, choice=1).seed is None


def test_n_choices_each_decode_and_count_in_the_usage(client):
    """n sampled choices: indexes 0..n-1, each its own text (seeded apart), the usage counting
    the prompt once and every choice's tokens. (Not compared with single requests seeded
    seed + i: in bf16 a batch of three rounds its logits otherwise than a batch of one, which
    can move a sampled token at a near-tie.)"""
    options = dict(model="smollm2", max_tokens=12, temperature=1.0, seed=7)
    options |= dict(prompt="Once upon a time", extra_body={"ignore_eos": True})
    reply = client.completions.create(n=3, **options)
    alone = client.completions.create(**options)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 3
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * 12


def test_several_prompts_get_n_choices_each_in_prompt_order(client):
    """A list of prompts (texts or token ids): prompt p's choices are p * n .. p * n + n - 1,
    the usage counting every prompt once."""
    prompts = [PROMPT, "Once upon a time"]
    options = dict(model="smollm2", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    reply = client.completions.create(prompt=prompts, n=2, **options)
    alone = [client.completions.create(prompt=p, **options) for p in prompts]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    assert texts[0] == texts[1] != texts[2] == texts[3]  # greedy: a prompt's choices agree
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 4 * 8
    by_ids = client.completions.create(prompt=[[1, 2, 3], [4, 5]], **options)
    assert [c.index for c in by_ids.choices] == [0, 1] and by_ids.usage.prompt_tokens == 5


def test_more_choices_than_the_queue_holds_get_a_503_and_queue_none(server):
    """16 prompts x 16 choices: past the server's 64 waiting requests the engine refuses
    one, and the choices submitted before it are cancelled, not left to decode."""
    body = {"model": "smollm2", "prompt": [PROMPT] * 16, "n": 16, "max_tokens": 200,
            "ignore_eos": True}  # fmt: skip
    before = server.metric("specrun_generated_tokens_total")
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_overloaded"
    server.wait_idle(timeout=10.0)
    # Uncancelled, the 72 choices the slots and the queue took would decode 200 tokens each.
    generated = server.metric("specrun_generated_tokens_total") - before
    assert generated < 200 * 8, "the queued choices decoded instead of being cancelled"


def test_streamed_choices_come_by_index_and_match_the_whole_reply(server, client):
    options = dict(model="smollm2", messages=QUESTION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(n=2, **options)
    chunks = list(client.chat.completions.create(n=2, stream=True, **options))
    texts, roles, finishes = {0: "", 1: ""}, {}, {}
    for chunk in chunks:
        [choice] = chunk.choices
        roles.setdefault(choice.index, choice.delta.role)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    server.wait_idle()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**6}, None),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_k": 10**7}, None),
        ({"prompt": "hi", "seed": -3}, "seed"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "logprobs": 3}, "logprobs"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ["hi", ""]}, "prompt"),
        ({"prompt": ["hi"] * 17}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_requests_get_a_400_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"].split(".")[0] == param, error


def test_bad_chat_requests_and_malformed_json(server):
    url = f"{server.url}/v1/chat/completions"
    for body in ({"messages": []}, {"messages": [{"role": "user"}]},
                 {"messages": [{"role": "wizard", "content": "hi"}]}):  # fmt: skip
        reply = httpx.post(url, json={"model": "smollm2", **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("messages")
    reply = httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["message"]
    reply = httpx.post(url, json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
    server.wait_idle()


@pytest.mark.parametrize("num_choices", [1, 2])
def test_a_client_disconnecting_mid_stream_frees_its_requests(server, num_choices):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True, "n": num_choices}  # fmt: skip
    cancelled = server.metric("specrun_requests_cancelled_total")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as reply:
        # Held: a line iterator dropped by `break` is finalised at once, closing the connection.
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"]
                break
        assert server.metric("specrun_requests_running") == num_choices
    # The cancellation counter, not the wait, tells freed requests from ones that ran their
    # 400 tokens out: the wait only has to outlast a loaded machine's round and scrape.
    server.wait_idle(timeout=10.0)
    assert server.metric("specrun_requests_cancelled_total") - cancelled == num_choices
