"""The Engine's public boundary: its defaults (the embedded model speculates with the shipped
head) and odd inputs, each refused with a TypeError/ValueError that says what to pass and
leaves the engine decoding as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrun.models.default import default_head_dir
from specrun.runtime import Engine, EngineConfig, SamplingParams
from specrun.runtime.config import default_trees, head_acceptance

PROMPT = "What is 7 * 8?"
PARAMS = SamplingParams(max_new_tokens=16)


@pytest.fixture(scope="module")
def default_engine(smollm_dir) -> Engine:
    """`Engine.from_pretrained()` as the README's first example calls it, on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECRUN_CACHE_DIR", str(smollm_dir.parent))
        engine = Engine.from_pretrained()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(default_engine) -> list[int]:
    return default_engine.generate(PROMPT, PARAMS)[0].token_ids


def test_the_embedded_model_speculates_with_the_shipped_head_by_default(default_engine, expected):
    assert default_engine.head is not None
    assert dict(default_engine.config.trees) == dict(default_trees(default_head_dir()))
    assert default_engine.acceptance == head_acceptance(default_head_dir()) is not None
    assert default_engine.decoder.planner.new_book().priors.keys() == {False}  # sampling
    plain = Engine(default_engine.model, default_engine.tokenizer, default_engine.config)
    assert plain.generate(PROMPT, PARAMS)[0].token_ids == expected
    stats = default_engine.stats()
    # A trained head on a short arithmetic answer: drafts are accepted, so a round yields more
    # than the one token plain decoding would.
    assert stats.num_rounds < stats.num_generated_tokens
    assert stats.mean_accepted_length > 1.5


def test_draft_false_decodes_plainly_and_other_values_are_refused(smollm_dir):
    config = EngineConfig(device="cpu", buckets=(1,))
    engine = Engine.from_pretrained(smollm_dir, config=config)
    assert engine.head is None  # another model: no head unless one is named
    with pytest.raises(TypeError, match="draft must be"):
        Engine.from_pretrained(smollm_dir, draft=1, config=config)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine.from_pretrained(smollm_dir, config={"device": "cpu"})


@pytest.mark.parametrize(
    ("prompts", "params", "error", "match"),
    [
        ({"role": "user", "content": "hi"}, PARAMS, TypeError, "got dict"),
        (torch.tensor([1, 2, 3]), PARAMS, TypeError, r"tolist\(\)"),
        (np.array([1, 2, 3]), PARAMS, TypeError, r"tolist\(\)"),
        ([torch.tensor([1, 2, 3])], PARAMS, TypeError, r"tolist\(\)"),
        (7, PARAMS, TypeError, "got int"),
        ([], PARAMS, ValueError, "empty"),
        (PROMPT, [], ValueError, "got 0 SamplingParams for 1 prompts"),
        (PROMPT, "greedy", TypeError, "got str"),
        (PROMPT, SamplingParams, TypeError, "not the class"),
        (PROMPT, [PARAMS, PARAMS], ValueError, "one per prompt"),
        (PROMPT, SamplingParams(top_k=10**6), ValueError, "top_k"),
        (PROMPT, SamplingParams(stop_token_ids=(10**6,)), ValueError, "stop_token_ids"),
    ],
)
def test_odd_inputs_are_refused_and_the_engine_still_decodes(
    default_engine, expected, prompts, params, error, match
):
    with pytest.raises(error, match=match):
        default_engine.generate(prompts, params)
    assert default_engine.generate(PROMPT, PARAMS)[0].token_ids == expected


def test_stream_refuses_a_bad_request_at_the_call(default_engine, expected):
    with pytest.raises(ValueError, match="empty"):
        default_engine.stream("")
    with pytest.raises(TypeError, match="got int"):
        default_engine.stream(PROMPT, [3])
    text = "".join(default_engine.stream(PROMPT, PARAMS))
    assert text == default_engine.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SamplingParams(seed=2**64), ValueError, "seed"),
        (lambda: SamplingParams(seed=-1), ValueError, "seed"),
        (lambda: SamplingParams(ignore_eos=1), TypeError, "ignore_eos"),
        (lambda: SamplingParams(ignore_eos="false"), TypeError, "ignore_eos"),
        (lambda: EngineConfig(queue="no"), TypeError, "queue"),
        (lambda: EngineConfig(chat_template=None), TypeError, "chat_template"),
        (lambda: EngineConfig(compile="yes"), TypeError, "compile"),
        (lambda: EngineConfig(device=0), TypeError, "device"),
    ],
)
def test_bad_options_are_refused_where_they_are_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_the_largest_seed_is_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
