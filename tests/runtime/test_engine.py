"""The Engine on the embedded SmolLM2: text in/out, streaming, speculation, stats, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specrun.models.config import DraftConfig
from specrun.models.eagle import build_draft
from specrun.models.loading import save_draft
from specrun.models.packed_linear import PackedLinear
from specrun.runtime import Engine, EngineConfig, SamplingParams
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft

DEPTH = 3
CONFIG = EngineConfig(
    device="cpu",
    dtype="float32",
    buckets=(1, 2, 4),
    trees={1: TreeShape(DEPTH, 3, 8), 2: TreeShape(DEPTH, 3, 8)},
    max_seq_len=512,
    policy="fixed",
)


@pytest.fixture(scope="module")
def engine(smollm_dir) -> Engine:
    return Engine.from_pretrained(smollm_dir, config=CONFIG)


@pytest.fixture(scope="module")
def spec_engine(smollm_dir, engine, tmp_path_factory) -> Engine:
    torch.manual_seed(0)
    config = DraftConfig(kind="eagle1", layer=engine.model.config)
    head_dir = save_draft(build_draft(config, engine.model), tmp_path_factory.mktemp("head"))
    return Engine.from_pretrained(smollm_dir, draft=head_dir, config=CONFIG)


def _assert_tokens_match_rounds(output, depth: int) -> None:
    """The prefill emits one token and every round its accepted draft tokens and the bonus,
    except the request's last round, which max_new_tokens or a stop token may cut short by
    at most `depth` tokens (plain decoding, depth 0: exactly one token a round)."""
    most = 1 + output.stats.num_rounds + output.stats.num_accepted
    assert most - depth <= len(output.token_ids) <= most, (output.token_ids, output.stats)


def test_generate_stream_and_speculation_agree(engine, spec_engine):
    params = SamplingParams(max_new_tokens=12)
    prompts = ["What is the capital of France?", [1, 2, 3, 4]]
    plain = engine.generate(prompts, params)
    spec = spec_engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert plain[0].text == engine.tokenizer.decode(plain[0].token_ids, skip_special_tokens=True)
    assert "Paris" in plain[0].text
    for out in plain:
        assert out.stats.num_accepted == 0
        _assert_tokens_match_rounds(out, depth=0)
    for out in spec:
        _assert_tokens_match_rounds(out, depth=DEPTH)
    # The engine's totals of its one batch are its requests' counts.
    stats = spec_engine.stats()
    assert stats.num_requests == 2
    assert stats.num_generated_tokens == sum(len(o.token_ids) for o in spec)
    # The loop may start the first request before the second is submitted.
    rounds = [o.stats.num_rounds for o in spec]
    assert max(rounds) <= stats.num_rounds <= sum(rounds)
    assert len(stats.accepted_histogram) == DEPTH + 1
    assert sum(stats.accepted_histogram) == sum(o.stats.num_rounds for o in spec)
    accepted = sum(a * n for a, n in enumerate(stats.accepted_histogram))
    assert accepted == sum(o.stats.num_accepted for o in spec)
    assert "".join(spec_engine.stream(prompts[0], params)) == spec[0].text
    assert spec_engine.stats().num_requests == 3


def test_an_eager_cpu_engine_multiplies_by_packed_weights(engine, spec_engine):
    for model in (engine.model, spec_engine.model, spec_engine.decoder.head):
        modules = list(model.modules())
        assert not any(isinstance(m, torch.nn.Linear) for m in modules)
        assert any(isinstance(m, PackedLinear) for m in modules)
    assert spec_engine.decoder.head.shared.lm_head is spec_engine.model.lm_head


def test_a_perfect_draft_is_accepted_whole_in_every_round_but_the_last(engine):
    """With the target as its draft (TargetAsDraft) the tree holds the target's greedy path,
    so every round but the request's last accepts all DEPTH draft tokens."""
    perfect = Engine(engine.model, engine.tokenizer, CONFIG, head=TargetAsDraft(engine.model))
    params = SamplingParams(max_new_tokens=12)
    (want,) = engine.generate("What is the capital of France?", params)
    (out,) = perfect.generate("What is the capital of France?", params)
    assert out.token_ids == want.token_ids
    rounds, accepted = out.stats.num_rounds, out.stats.num_accepted
    assert rounds >= 2 and accepted >= DEPTH * (rounds - 1), out.stats
    _assert_tokens_match_rounds(out, depth=DEPTH)


def test_stop_at_eos_and_finish_reasons(engine):
    (out,) = engine.generate("Say hi.", SamplingParams(max_new_tokens=200))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.tokenizer.eos_token_ids
    (cut,) = engine.generate("Say hi.", SamplingParams(max_new_tokens=2))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ("   ", ValueError, "empty"),
        ([], ValueError, "empty"),
        ([1, 10**9], ValueError, "outside"),
        ([0] * 9000, ValueError, "context"),
    ],
)
def test_bad_prompts_are_refused(engine, prompt, error, match):
    with pytest.raises(error, match=match):
        engine.generate([prompt], SamplingParams(max_new_tokens=1))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(TypeError, match="TreeShape"):
        EngineConfig(trees={1: (7, 10, 60)})
    with pytest.raises(ValueError, match="num_nodes"):
        TreeShape(depth=1, topk=2, num_nodes=9)


@pytest.mark.parametrize(
    ("capabilities", "want"),
    [
        ({"avx512_bf16": True, "amx_bf16": False}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": True}, torch.bfloat16),
        ({"avx512_bf16": False, "amx_bf16": False, "avx512_f": True}, torch.float32),
        ({"architecture": "arm64", "bf16": True}, torch.float32),
    ],
)
def test_auto_dtype_is_bfloat16_where_the_cpu_multiplies_it_natively(
    monkeypatch, capabilities, want
):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert EngineConfig(device="cpu").resolved_dtype() == want
    assert EngineConfig(device="cpu", dtype="float32").resolved_dtype() == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert EngineConfig(device="cpu").resolved_dtype() == torch.float32
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    assert EngineConfig(device="cpu").resolved_dtype() == torch.float32


def test_batches_above_the_largest_bucket_are_queued_or_refused(engine):
    params = SamplingParams(max_new_tokens=2)
    prompts = [[1, 2, 3 + i] for i in range(6)]
    outputs = engine.generate(prompts, params)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(len(o.token_ids) == 2 for o in outputs)
    strict = Engine(engine.model, engine.tokenizer, dataclasses.replace(CONFIG, queue=False))
    with pytest.raises(ValueError, match="queue=True"):
        strict.generate(prompts, params)
    with pytest.raises(ValueError, match="max_seq_len"):
        strict.generate([[1, 2]], SamplingParams(max_new_tokens=600))
