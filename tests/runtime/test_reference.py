"""Reference decoding: batching invariance, agreement with transformers, stops and errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrun.runtime.config import SamplingParams
from specrun.runtime.reference import reference_generate, reference_stream
from tiny_models import random_llama, tiny_config

transformers = pytest.importorskip("transformers")


def _hf_twin(model):
    """transformers LlamaForCausalLM with the same weights as our model."""
    hf_config = transformers.LlamaConfig(**model.config.to_hf())
    hf = transformers.LlamaForCausalLM(hf_config).to(model.lm_head.weight.dtype).eval()
    state = {
        (k if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()
    }
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    return hf


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    max_new=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_ragged_batch_equals_each_prompt_alone(lengths, max_new, seed):
    model = random_llama(tiny_config(), seed=seed % 7, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=max_new)
    batched = reference_generate(model, prompts, params)
    for prompt, result in zip(prompts, batched, strict=True):
        (alone,) = reference_generate(model, [prompt], params)
        assert result.token_ids == alone.token_ids
        assert len(result.token_ids) == max_new


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_greedy_matches_transformers_generate(num_kv_heads):
    model = random_llama(tiny_config(num_kv_heads=num_kv_heads), dtype=torch.float64)
    hf = _hf_twin(model)
    prompt = [5, 17, 3, 88, 41, 2]
    (ours,) = reference_generate(model, [prompt], SamplingParams(max_new_tokens=20))
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert ours.token_ids == theirs[0, len(prompt) :].tolist()


def test_eos_and_stop_tokens(tiny_llama):
    prompt = [1, 2, 3, 4]
    (free,) = reference_generate(tiny_llama, [prompt], SamplingParams(max_new_tokens=12))
    eos = free.token_ids[4]
    first = free.token_ids.index(eos)
    (stopped,) = reference_generate(
        tiny_llama, [prompt], SamplingParams(max_new_tokens=12), eos_token_ids=[eos]
    )
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    (ignored,) = reference_generate(
        tiny_llama,
        [prompt],
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        eos_token_ids=[eos],
    )
    assert ignored.token_ids == free.token_ids
    assert ignored.finish_reason == "length"
    (by_stop_id,) = reference_generate(
        tiny_llama, [prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(eos,))
    )
    assert by_stop_id == stopped


def test_mixed_batch_limits_and_zero_tokens(tiny_llama):
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = [SamplingParams(max_new_tokens=n) for n in (0, 3, 7)]
    results = reference_generate(tiny_llama, prompts, params)
    assert [len(r.token_ids) for r in results] == [0, 3, 7]
    assert all(r.finish_reason == "length" for r in results)
    steps = list(reference_stream(tiny_llama, prompts, params))
    assert len(steps) == 7
    assert steps[0][0] == (None, None)


def test_seeded_sampling_reproduces_and_varies(tiny_llama):
    prompts = [[7, 8, 9]]
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=16, seed=3)
    a = reference_generate(tiny_llama, prompts, params)
    b = reference_generate(tiny_llama, prompts, params)
    c = reference_generate(
        tiny_llama, prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=4)
    )
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("prompts", "params", "error", "match"),
    [
        ([[]], SamplingParams(), ValueError, "empty"),
        ([[1, 500]], SamplingParams(), ValueError, "outside"),
        ([[1, -1]], SamplingParams(), ValueError, "outside"),
        ([], SamplingParams(), ValueError, "non-empty"),
        (["hello"], SamplingParams(), TypeError, "token ids"),
        ([[1.5]], SamplingParams(), TypeError, "int"),
        ([[1], [2]], [SamplingParams()], ValueError, "2 prompts"),
    ],
)
def test_bad_requests_are_refused(tiny_llama, prompts, params, error, match):
    with pytest.raises(error, match=match):
        reference_generate(tiny_llama, prompts, params)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"stop_token_ids": "abc"}, TypeError, "stop_token_ids"),
        ({"stop_token_ids": (-3,)}, ValueError, "stop_token_ids"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)
