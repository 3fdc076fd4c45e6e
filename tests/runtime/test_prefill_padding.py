"""The device side of a prefill over prompts padded past their length, as a prefill graph runs it.

A CUDA-graph prefill (decoder.py) pads every prompt of a batch to the graph's length
(`prefill_length`) and replays `prefill_forwards` over those static buffers, after
`reset_requests`. Here, on the CPU and in float64, padding a batch to any longer length must
leave exactly the state the unpadded prefill leaves (root, the caches up to each slot's length,
the draft's pending pair, outputs, report), and running the forwards twice over the same
inputs (the graph's warm-up runs) must rebuild the same state.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.prefill import (
    allocate_state,
    padded_prompts,
    prefill,
    prefill_forwards,
    prefill_length,
    reset_requests,
)
from specrun.runtime.requests import stop_mask
from specrun.runtime.round import SpecState
from specrun.runtime.sampling import SamplingTensors
from tiny_models import random_head, random_llama, tiny_config

EOS = (11,)
CAPACITY = 96
DEPTH = 3


@pytest.fixture(scope="module")
def models():
    target = random_llama(tiny_config(head_dim=16, vocab_size=97), seed=1, dtype=torch.float64)
    return target, random_head("eagle3", target, seed=2)


def _state(target, head, batch_size: int) -> SpecState:
    state = allocate_state(target, head, batch_size=batch_size, capacity=CAPACITY, depth=DEPTH)
    # Stale values from an earlier batch: a prefill must overwrite or ignore all of them.
    for tensor in (state.target.k, state.target.v, state.draft.k, state.draft.v):
        tensor.normal_()
    for tensor in (state.target.lengths, state.draft.lengths, state.num_output, state.finish):
        tensor.fill_(5)
    return state


def _padded_prefill(target, head, state, prompts, params, *, length: int) -> torch.Tensor:
    reset_requests(state, params, EOS, vocab_size=target.config.vocab_size)
    tokens, lengths = padded_prompts(prompts, length=length)
    return prefill_forwards(target, head, state, tokens, lengths)


def _assert_same_state(got: SpecState, want: SpecState) -> None:
    for name in ("root", "num_output", "done", "finish", "max_new"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.output[:, :1], want.output[:, :1])
    for cache_name in ("target", "draft"):
        got_cache, want_cache = getattr(got, cache_name), getattr(want, cache_name)
        assert torch.equal(got_cache.lengths, want_cache.lengths), cache_name
        for slot, length in enumerate(want_cache.lengths.tolist()):
            for field in ("k", "v"):
                got_kv = getattr(got_cache, field)[:, slot, :, :length]
                want_kv = getattr(want_cache, field)[:, slot, :, :length]
                torch.testing.assert_close(got_kv, want_kv, rtol=1e-12, atol=1e-12)
    for field in dataclasses.fields(want.pending):
        got_pending, want_pending = (getattr(s.pending, field.name) for s in (got, want))
        torch.testing.assert_close(got_pending, want_pending, rtol=1e-12, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    extra=st.integers(0, 30),
    max_new=st.integers(0, 3),
)
def test_padding_past_the_prompts_leaves_the_unpadded_prefills_state(
    models, lengths, extra, max_new
):
    target, head = models
    prompts = [[(5 * slot + 7 * j) % 90 + 1 for j in range(n)] for slot, n in enumerate(lengths)]
    params = [SamplingParams(max_new_tokens=max_new)] * len(prompts)
    with torch.inference_mode():
        want_state = _state(target, head, len(prompts))
        want = prefill(target, head, want_state, prompts, params, EOS)
        got_state = _state(target, head, len(prompts))
        length = max(3, *lengths) + extra
        got = _padded_prefill(target, head, got_state, prompts, params, length=length)
    assert torch.equal(got, want)
    _assert_same_state(got_state, want_state)


def test_running_the_forwards_again_rebuilds_the_same_state(models):
    target, head = models
    prompts = [[3, 4, 5, 6], [7, 8], [9] * 20]
    params = [SamplingParams(max_new_tokens=4)] * len(prompts)
    with torch.inference_mode():
        once = _state(target, head, len(prompts))
        report_once = _padded_prefill(target, head, once, prompts, params, length=24)
        twice = _state(target, head, len(prompts))
        reset_requests(twice, params, EOS, vocab_size=target.config.vocab_size)
        tokens, lengths = padded_prompts(prompts, length=24)
        prefill_forwards(target, head, twice, tokens, lengths)
        report_twice = prefill_forwards(target, head, twice, tokens, lengths)
    assert torch.equal(report_twice, report_once)
    _assert_same_state(twice, once)


request_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.3]),
    top_k=st.integers(0, 96),
    top_p=st.sampled_from([1.0, 0.9, 0.123]),
    max_new_tokens=st.integers(0, 40),
    stop_token_ids=st.lists(st.integers(0, 120), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(params=st.lists(request_params, min_size=1, max_size=4))
def test_reset_requests_writes_every_requests_fields(models, params):
    """The packed transfer leaves what building each field from the params gives, whatever
    a stale earlier batch left."""
    target, head = models
    vocab_size = target.config.vocab_size
    state = _state(target, head, len(params))
    state.stop_mask.fill_(True)
    state.done.fill_(True)
    reset_requests(state, params, EOS, vocab_size=vocab_size)
    want = SamplingTensors.from_params(params, "cpu")
    for name in ("temperature", "top_k", "top_p"):
        assert torch.equal(getattr(state.sampling, name), getattr(want, name)), name
    max_new = torch.tensor([p.max_new_tokens for p in params])
    assert torch.equal(state.max_new, max_new)
    assert torch.equal(state.done, max_new == 0)
    assert torch.equal(state.stop_mask, stop_mask(params, EOS, vocab_size=vocab_size, device="cpu"))


def test_graph_lengths_step_by_at_most_half_and_stop_at_the_capacity():
    lengths = [prefill_length(n, max_length=10_000) for n in range(1, 5000)]
    assert lengths[:16] == [16] * 16
    ladder = sorted(set(lengths))
    assert ladder[:9] == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert all(b <= 3 * a // 2 for a, b in itertools.pairwise(ladder))
    assert all(n <= length for n, length in enumerate(lengths, start=1))
    assert prefill_length(1900, max_length=2048) == 2048
    assert prefill_length(2048, max_length=2048) == 2048
    assert prefill_length(5, max_length=10) == 10


def test_padded_prompts_refuse_a_length_shorter_than_a_prompt():
    tokens, lengths = padded_prompts([[1, 2], [3]], length=5)
    assert tokens.tolist() == [[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]]
    assert lengths.tolist() == [2, 1]
    with pytest.raises(AssertionError):
        padded_prompts([[1, 2, 3, 4]], length=3)


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_prefill_graph_tokens_is_checked(value, error):
    with pytest.raises(error, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=value)
