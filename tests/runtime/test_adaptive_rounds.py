"""Rounds whose shape changes every round (a policy that picks at random among the bucket's
ladder, plain rounds that append to the pending pairs and that commit them included) decode
exactly what the reference decoder does, keep the draft in step through plain rounds, and
sample seeded requests as the reference does (top-k trees)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.reference import reference_generate
from specrun.runtime.stats import DecodeStats
from specrun.runtime.tree import TreeShape
from tiny_models import (
    ShuffledPolicy,
    TargetAsDraft,
    decode_tokens,
    random_head,
    random_llama,
    tiny_config,
)

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12]]
TREES = {1: TreeShape(4, 3, 10), 2: TreeShape(3, 2, 6), 4: TreeShape(2, 2, 4)}


def _decoder(target, head, seed: int) -> tuple[Decoder, ShuffledPolicy]:
    config = EngineConfig(device="cpu", buckets=(1, 2, 4), trees=TREES, max_seq_len=128)
    decoder = Decoder(target, head, config)
    decoder.planner.policy = ShuffledPolicy(seed)
    return decoder, decoder.planner.policy


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(), dtype=torch.float64)


@pytest.mark.parametrize("kind", ["perfect", "eagle3", "eagle1"])
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_greedy_decoding_with_shapes_changing_every_round_is_the_reference(
    target, kind, num_prompts
):
    head = TargetAsDraft(target) if kind == "perfect" else random_head(kind, target)
    decoder, policy = _decoder(target, head, seed=num_prompts)
    params = [SamplingParams(max_new_tokens=n) for n in (30, 17, 23)][:num_prompts]
    stats = DecodeStats()
    got, _ = decode_tokens(decoder, PROMPTS[:num_prompts], params, stats=stats)
    want = reference_generate(target, PROMPTS[:num_prompts], params)
    assert got == [w.token_ids for w in want]
    assert "plain" in stats.rounds_by_shape and len(stats.rounds_by_shape) >= 3
    ran = [tree for tree, _ in policy.observed]
    plain_after_plain = any(a is None and b is None for a, b in itertools.pairwise(ran))
    assert plain_after_plain and any(tree is not None for tree in ran)


def test_the_draft_stays_in_step_through_plain_rounds(target):
    """A perfect draft of a peaked target accepts every level of every speculative round,
    however many plain rounds came before it: plain rounds commit exactly the pairs the draft
    would have seen (the request's last round aside, cut by max_new_tokens)."""
    peaked = random_llama(tiny_config(vocab_size=61, num_layers=2), dtype=torch.float64)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(30.0)
    decoder, policy = _decoder(peaked, TargetAsDraft(peaked), seed=7)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    got, _ = decode_tokens(decoder, [[1, 2, 3]], [params])
    assert got == [reference_generate(peaked, [[1, 2, 3]], [params])[0].token_ids]
    speculative = [(tree, accepted) for tree, accepted in policy.observed if tree is not None]
    assert len(speculative) >= 5 and len(speculative) < len(policy.observed)
    for tree, accepted in speculative[:-1]:
        assert accepted == [tree.depth], policy.observed


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_plain_rounds_leave_the_draft_cache_as_speculation_alone_does(target, kind):
    """Whatever mix of shapes ran, the draft cache holds exactly the pairs the fixed tree
    leaves (one entry per committed position but the pending ones, which plain rounds that
    append may leave more of)."""
    head = random_head(kind, target)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (26, 19)]
    states = []
    for policy in ("shuffled", "fixed"):
        config = EngineConfig(
            device="cpu", buckets=(2,), trees=TREES, max_seq_len=128, policy="fixed"
        )
        decoder = Decoder(target, head, config)
        if policy == "shuffled":
            decoder = _decoder(target, head, seed=3)[0]
        decode_tokens(decoder, PROMPTS[:2], params)
        states.append(decoder.state(2))
    shuffled, fixed = states
    for state in states:
        assert torch.equal(state.draft.lengths + state.pending.num_valid, state.target.lengths)
    assert torch.equal(shuffled.target.lengths, fixed.target.lengths)
    common = torch.minimum(shuffled.draft.lengths, fixed.draft.lengths)
    assert common.min() >= 16  # prompts of 5 and 2 tokens, 26 and 19 new ones
    for row, length in enumerate(common.tolist()):
        for name in ("k", "v"):
            torch.testing.assert_close(
                getattr(shuffled.draft, name)[:, row, :, :length],
                getattr(fixed.draft, name)[:, row, :, :length],
            )


def test_seeded_sampling_with_shapes_changing_every_round_is_the_reference(target):
    """Top-k trees verify sampled requests with the target's own keyed draws, so whatever the
    shape sequence a seeded request samples exactly the reference decoder's tokens."""
    head = random_head("eagle3", target)
    params = [
        SamplingParams(temperature=t, top_p=p, max_new_tokens=20, seed=s, ignore_eos=True)
        for t, p, s in ((1.0, 1.0, 3), (0.7, 0.9, 12), (1.3, 1.0, 5))
    ]
    want = [g.token_ids for g in reference_generate(target, PROMPTS[:3], params)]
    for seed in (1, 2):
        decoder, _ = _decoder(target, head, seed=seed)
        assert decode_tokens(decoder, PROMPTS[:3], params)[0] == want


def _recording_plans(decoder: Decoder) -> list:
    """The list the decoder's planner appends each planned round to."""
    planned, plan = [], decoder.planner.plan

    def recorded(*args, **kwargs):
        planned.append(plan(*args, **kwargs))
        return planned[-1]

    decoder.planner.plan = recorded
    return planned


@pytest.mark.parametrize("sampled", [False, True])
def test_drafts_left_behind_for_good_still_decode_the_reference(target, sampled):
    """Plain rounds that leave the drafts behind (bare steps, the pending pairs untouched)
    and tree rounds after them (drafts out of step, never accepted but by chance) decode the
    reference's tokens, greedy and seeded sampling alike."""
    head = random_head("eagle3", target)
    temperature = 1.0 if sampled else 0.0
    params = [
        SamplingParams(temperature=temperature, max_new_tokens=n, seed=n, ignore_eos=True)
        for n in (28, 21, 25)
    ]
    want = [g.token_ids for g in reference_generate(target, PROMPTS[:3], params)]
    num_left_behind = num_stale_trees = 0
    for seed in (1, 2, 3):
        decoder, _ = _decoder(target, head, seed=seed)
        decoder.planner.policy = ShuffledPolicy(seed, leave_behind=0.5)
        planned = _recording_plans(decoder)
        assert decode_tokens(decoder, PROMPTS[:3], params)[0] == want
        bare = [i for i, v in enumerate(planned) if v.tree is None and not v.appends]
        bare = [i for i in bare if not planned[i].num_pending]
        if bare:
            num_left_behind += 1
            assert not any(v.appends or v.num_pending for v in planned[bare[0] :])
            num_stale_trees += sum(v.tree is not None for v in planned[bare[0] :])
    assert num_left_behind >= 2 and num_stale_trees
