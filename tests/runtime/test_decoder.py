"""The decoder's host logic on the CPU: bucket padding, the per-bucket tree table, state reuse
across batches (an abandoned stream included), capacity and bucket errors, statistics.

Greedy decoding of tiny float64 models is exact, so every path must reproduce the reference
decoder token for token whatever the bucket, padding or history of the shared state.
"""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from specrun.models.default import default_head_dir
from specrun.runtime import round as round_module
from specrun.runtime.acceptance import AcceptanceEstimate, MeasuredAcceptance
from specrun.runtime.config import (
    DEFAULT_TREES,
    HEAD_TREES_FILE,
    EngineConfig,
    SamplingParams,
    default_trees,
    head_acceptance,
)
from specrun.runtime.decoder import Decoder
from specrun.runtime.policies import Policy
from specrun.runtime.reference import reference_generate
from specrun.runtime.round_plan import RoundVariant
from specrun.runtime.stats import DecodeStats
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, decode_tokens, random_llama, tiny_config

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 42]]
EOS = (11,)


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(), dtype=torch.float64)


def _decoder(target, **overrides) -> Decoder:
    fields = dict(
        device="cpu",
        buckets=(1, 2, 4),
        trees={1: TreeShape(4, 3, 10), 2: TreeShape(2, 2, 4), 4: None},
        max_seq_len=64,
    )
    return Decoder(
        target, TargetAsDraft(target), EngineConfig(**(fields | overrides)), eos_token_ids=EOS
    )


def _reference(target, prompts, params):
    want = reference_generate(target, prompts, params, eos_token_ids=EOS)
    return [w.token_ids for w in want], [w.finish_reason for w in want]


@pytest.mark.parametrize("num_prompts", [1, 2, 3, 4])
def test_every_bucket_and_padding_reproduce_the_reference(target, num_prompts):
    """1: deep tree, 2: shallow tree, 3 pads to 4, whose table entry is plain decoding."""
    decoder = _decoder(target)
    params = [SamplingParams(max_new_tokens=n) for n in (20, 7, 13, 1)][:num_prompts]
    prompts = PROMPTS[:num_prompts]
    assert decode_tokens(decoder, prompts, params) == _reference(target, prompts, params)


def test_state_is_reset_between_batches_and_after_an_abandoned_stream(target):
    decoder = _decoder(target)
    params = SamplingParams(max_new_tokens=15, ignore_eos=True)
    steps = decoder.stream(PROMPTS[:2], params)
    next(steps)
    next(steps)
    steps.close()
    for prompts in (PROMPTS[2:4], PROMPTS[:2], PROMPTS[4:]):
        assert decode_tokens(decoder, prompts, params) == _reference(target, prompts, params)


def test_preparing_exempts_what_it_built_from_garbage_collection(target):
    """What compiling leaves alive is frozen (decoder.settle_heap), so no later full
    collection scans it; preparing again builds nothing and leaves the heap alone."""
    decoder = _decoder(target, compile=True, policy="fixed")
    gc.unfreeze()
    decoder.prepare(1)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    gc.unfreeze()
    decoder.prepare(1)
    decoder.warmup(buckets=[1])
    assert gc.get_freeze_count() == 0
    decoder.warmup(buckets=[2])
    assert gc.get_freeze_count() > 0


def test_round_variants_follow_the_requests_and_the_buckets_trees(target):
    """With the fixed policy a stochastic bucket has a greedy round (its top-k tree), a
    sampled one and a top-k/top-p one; other buckets have no stochastic variant whatever the
    requests; a plain bucket of a decoder that speculates elsewhere keeps the draft in step at
    both pending widths; warm-up builds exactly these."""
    stochastic_tree = TreeShape(3, 2, 5, stochastic=True)
    top_k_tree, shallow = TreeShape(3, 2, 5), TreeShape(2, 2, 4)
    decoder = _decoder(target, trees={1: stochastic_tree, 2: shallow, 4: None}, policy="fixed")
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7)
    filtered = SamplingParams(temperature=0.7, top_p=0.9)
    stochastic = RoundVariant(tree=stochastic_tree)
    greedy_round = RoundVariant(tree=top_k_tree, greedy=True)  # draws no noise
    assert decoder.planner.variant_for(1, [greedy, greedy]) == greedy_round
    assert decoder.planner.variant_for(1, [greedy, sampled]) == stochastic
    assert decoder.planner.variant_for(1, [filtered]) == RoundVariant(
        tree=stochastic_tree, filtered=True
    )
    assert decoder.planner.variant_for(2, [greedy, sampled]) == RoundVariant(tree=shallow)
    assert decoder.planner.variant_for(4, [filtered]) == RoundVariant(filtered=True)
    assert decoder.planner.variants(1) == [greedy_round, stochastic]
    # A bucket whose configured tree is top-k runs it for greedy and sampling batches alike.
    assert decoder.planner.variant_for(2, [greedy]) == RoundVariant(tree=shallow)
    assert decoder.planner.variants(2, filtered=True) == [
        RoundVariant(tree=shallow),
        RoundVariant(tree=shallow, filtered=True),
    ]
    plain = [RoundVariant(appends=True), RoundVariant(num_pending=4)]  # depth 3: 4 wide
    assert decoder.planner.variants(4) == plain
    assert set(decoder.warmup()) == {
        (1, greedy_round),
        (1, stochastic),
        (2, RoundVariant(tree=shallow)),
        *((4, variant) for variant in plain),
    }
    with pytest.raises(ValueError, match="runs none of"):
        decoder.prepare(2, variant=stochastic)


def test_an_adaptive_policy_builds_each_buckets_ladder(target):
    """Under the cost policy every bucket may run its tree, smaller ones and plain decoding;
    plain rounds append to the pending pairs or commit them; a plain-only decoder (no head)
    has no ladder."""
    decoder = _decoder(target)
    assert decoder.planner.shapes(1) == (
        TreeShape(4, 3, 10),
        TreeShape(3, 2, 4),
        TreeShape(2, 2, 3),
        None,
    )
    assert decoder.planner.shapes(4) == (None,)
    greedy = [SamplingParams()]
    assert [v.tree for v in decoder.planner.candidates(1, greedy)] == list(
        decoder.planner.shapes(1)
    )
    assert RoundVariant(appends=True) in decoder.planner.launchable(1, greedy)
    assert RoundVariant(num_pending=5) in decoder.planner.launchable(1, greedy)
    assert RoundVariant() in decoder.planner.launchable(1, greedy)
    plain = Decoder(target, None, EngineConfig(device="cpu", buckets=(1, 2)))
    assert plain.planner.shapes(1) == (None,)
    assert plain.planner.launchable(2, greedy) == [RoundVariant()]


class _ScriptedPolicy(Policy):
    """Picks the candidate whose tree is next in the script."""

    name = "scripted"

    def __init__(self, trees) -> None:
        self._trees = iter(trees)

    def choose(self, bucket, candidates, requests, costs):
        tree = next(self._trees)
        return next(c for c in candidates if c.tree == tree)


def test_plain_rounds_append_while_every_slot_has_room_then_commit(target):
    """The pending pairs are 5 wide (depth 4): plain rounds append until a slot may hold 5,
    then one commits them; a speculative round of depth D leaves at most D + 1."""
    decoder = _decoder(target)
    small = TreeShape(2, 2, 3)
    script = [None] * 6 + [small, None, None, None, TreeShape(4, 3, 10), None]
    decoder.planner.policy = _ScriptedPolicy(script)
    greedy = [SamplingParams()]
    planned = [decoder.planner.plan(1, greedy, [AcceptanceEstimate()]) for _ in script]
    appends, commits = RoundVariant(appends=True), RoundVariant(num_pending=5)
    assert planned == [
        *[appends] * 4, commits, appends,
        RoundVariant(tree=small), appends, appends, commits,
        RoundVariant(tree=TreeShape(4, 3, 10)), commits,
    ]  # fmt: skip
    assert all((1, v) in decoder.warmup() for v in set(planned))


def test_greedy_batches_run_a_stochastic_bucket_as_its_top_k_tree(target, monkeypatch):
    """Only a batch with a sampling request drafts the stochastic tree; an all-greedy batch
    runs the top-k round and decodes what the reference does."""
    calls = []
    stochastic_draft = round_module.draft_stochastic_tree

    def counted(*args, **kwargs):
        calls.append(1)
        return stochastic_draft(*args, **kwargs)

    monkeypatch.setattr(round_module, "draft_stochastic_tree", counted)
    decoder = _decoder(target, trees={1: TreeShape(3, 2, 5, stochastic=True), 2: None, 4: None})
    params = [SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=6)]
    assert decode_tokens(decoder, PROMPTS[:1], params[:1]) == _reference(
        target, PROMPTS[:1], params[:1]
    )
    assert not calls
    decode_tokens(decoder, PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=6))
    assert calls


@pytest.mark.parametrize("admitted", [False, True])
def test_prompts_prefilled_without_the_head_leave_an_empty_draft(target, admitted):
    """A batch prefill or an admission that is not drafted never runs the head: the draft
    cache stays empty and (root, zero feature) is pending; a drafted one runs it."""
    decoder = _decoder(target)
    head = decoder.head
    state = decoder.state(2)
    params = [SamplingParams(max_new_tokens=4)] * 2
    num_calls = []
    hook = head.register_forward_pre_hook(lambda *_: num_calls.append(1))
    try:
        for drafted in (True, False):
            num_calls.clear()
            with torch.no_grad():
                if admitted:
                    decoder.admit(2, [0, 1], PROMPTS[:2], params, drafted=drafted)
                else:
                    decoder.prefill_batch(2, PROMPTS[:2], params, drafted=drafted)
            assert bool(num_calls) == drafted
            assert state.draft.lengths.tolist() == ([4, 1] if drafted else [0, 0])
            assert state.pending.tokens[:, 0].tolist() == state.root.tolist()
            assert state.pending.num_valid.tolist() == [1, 1]
            assert bool(state.pending.features.any()) == drafted
            decoder.release(2, [0, 1])
    finally:
        hook.remove()


def test_stop_ids_max_new_zero_and_statistics(target):
    """A stop id ends the request at its first occurrence (the stop token included); the
    stop id is the fifth token the request decodes without stop ids, so it ends mid-answer."""
    decoder = _decoder(target)
    (free,), _ = _reference(target, PROMPTS[1:2], [SamplingParams(max_new_tokens=30)])
    assert len(free) == 30 and free[4] not in free[:4]
    params = [
        SamplingParams(max_new_tokens=0),
        SamplingParams(max_new_tokens=30, stop_token_ids=(free[4], 9)),
    ]
    stats = DecodeStats()
    got = decode_tokens(decoder, PROMPTS[:2], params, stats=stats)
    assert got == _reference(target, PROMPTS[:2], params)
    end = next(i for i, token in enumerate(free) if token in (free[4], 9)) + 1
    assert got == ([[], free[:end]], ["length", "stop"])
    assert stats.num_requests == 2 and len(stats.per_request) == 2
    assert stats.per_request[0].num_rounds == 0
    assert sum(stats.accepted_histogram) == stats.per_request[1].num_rounds > 0
    assert len(stats.accepted_histogram) == 3  # bucket 2: depth 2
    # The prefill emits one token, each round its accepted tokens and the bonus, the last
    # round cut short by the stop token (by at most the depth).
    most = 1 + stats.per_request[1].num_rounds + stats.per_request[1].num_accepted
    assert most - 2 <= end <= most


@pytest.mark.parametrize("speculates", [False, True], ids=["plain", "trees"])
def test_a_host_reading_a_round_late_launches_no_round_after_the_last(target, speculates):
    """One round behind the device, as on CUDA (`Decoder.host_lag`): a request with no more
    tokens left than rounds in flight ends with them, so plain decoding of 7 tokens launches
    6 rounds after the prefill, none unread; with trees every request still decodes what
    the reference does."""
    trees = {1: TreeShape(4, 3, 10), 2: TreeShape(2, 2, 4)} if speculates else {1: None}
    decoder = _decoder(target, trees=trees | {4: None})
    decoder.host_lag = 1
    launched = []
    runner = decoder.round_runner

    def counting(bucket, *, variant=None):
        launched.append(variant)
        return runner(bucket, variant=variant)

    decoder.round_runner = counting
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (7, 4)]
    stats = DecodeStats()
    assert decode_tokens(decoder, PROMPTS[:2], params, stats=stats) == _reference(
        target, PROMPTS[:2], params
    )
    if not speculates:
        assert len(launched) == stats.num_rounds == 6


def test_requests_that_do_not_fit_are_refused_before_any_state_changes(target):
    decoder = _decoder(target)
    params = SamplingParams(max_new_tokens=10)
    want = decode_tokens(decoder, PROMPTS[:1], params)
    with pytest.raises(ValueError, match="max_seq_len"):
        list(decoder.stream([[1] * 40], SamplingParams(max_new_tokens=20)))
    with pytest.raises(ValueError, match="largest bucket"):
        list(decoder.stream([[1]] * 5, params))
    assert decode_tokens(decoder, PROMPTS[:1], params) == want


def test_a_head_directory_carries_its_trees(tmp_path):
    """trees.json in a head directory goes over the default table; a malformed one is refused
    naming the file; the shipped head carries its tuned batch-1 tree."""
    assert default_trees(None) is DEFAULT_TREES and default_trees(tmp_path) is DEFAULT_TREES
    (tmp_path / HEAD_TREES_FILE).write_text(
        '{"trees": {"1": [5, 8, 32], "16": [2, 2, 4], "32": [2, 2, 3, true]}}'
    )
    trees = default_trees(tmp_path)
    assert trees[1] == TreeShape(5, 8, 32) and trees[16] == TreeShape(2, 2, 4)
    assert trees[32] == TreeShape(2, 2, 3, stochastic=True)
    assert {k: v for k, v in trees.items() if k not in (1, 16, 32)} == {
        k: v for k, v in DEFAULT_TREES.items() if k not in (1, 16, 32)
    }
    assert EngineConfig(trees=trees).tree_for(1) == TreeShape(5, 8, 32)
    bad = [
        "[",
        '{"tree": {}}',
        '{"trees": [1]}',
        '{"trees": {"1": [5, 8]}}',
        '{"trees": {"a": [5, 8, 32]}}',
        '{"trees": {"1": [5, 8, 32, 1]}}',
    ]
    for text in bad:
        (tmp_path / HEAD_TREES_FILE).write_text(text)
        with pytest.raises(ValueError, match=r"trees\.json"):
            default_trees(tmp_path)
    assert default_trees(default_head_dir())[1] == TreeShape(6, 8, 63, stochastic=True)


def test_a_head_directory_carries_what_it_accepted(tmp_path):
    """trees.json's `accepted` entry is the head's measured acceptance; a directory without
    one has none; a malformed entry is refused naming the file."""
    assert head_acceptance(None) is None and head_acceptance(tmp_path) is None
    (tmp_path / HEAD_TREES_FILE).write_text('{"trees": {"1": [5, 8, 32]}}')
    assert head_acceptance(tmp_path) is None
    (tmp_path / HEAD_TREES_FILE).write_text(
        '{"accepted": {"tree": [5, 8, 32], "greedy": 3.5, "sampling": 1.8}}'
    )
    assert head_acceptance(tmp_path) == MeasuredAcceptance(TreeShape(5, 8, 32), 3.5, 1.8)
    bad = [
        "[1]",
        '{"accepted": {"greedy": 3.5}}',
        '{"accepted": {"tree": [5, 8], "greedy": 3.5}}',
        '{"accepted": {"tree": [5, 8, 32], "greedy": 9.0}}',
        '{"accepted": [5, 8, 32]}',
    ]
    for text in bad:
        (tmp_path / HEAD_TREES_FILE).write_text(text)
        with pytest.raises(ValueError, match=r"trees\.json"):
            head_acceptance(tmp_path)
    shipped = head_acceptance(default_head_dir())
    assert shipped.tree == TreeShape(6, 8, 63) and shipped.greedy is None and shipped.sampling > 1


def test_engine_config_tree_table_and_bucket_choice():
    config = EngineConfig(buckets=(1, 4, 16), trees={1: TreeShape(3, 2, 5), 4: None})
    assert config.tree_for(1) == TreeShape(3, 2, 5)
    assert config.tree_for(4) is None and config.tree_for(16) is None
    assert [config.bucket_for(n) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(ValueError, match="bucket"):
        EngineConfig(buckets=(2, 1))
    with pytest.raises(ValueError, match="trees has no entry"):
        EngineConfig(buckets=(1, 2), trees={2: None})
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(device="cpu", cuda_graphs=True).resolved_cuda_graphs()


def test_engine_config_pickles_for_worker_processes():
    config = EngineConfig(buckets=(1, 4), trees={1: TreeShape(4, 3, 10), 4: None}, policy="fixed")
    again = pickle.loads(pickle.dumps(config))
    assert again == config and again.tree_for(4) is None
    with pytest.raises(TypeError):
        again.trees[1] = None
