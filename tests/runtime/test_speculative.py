"""Speculative decoding equals reference decoding (greedy) for drawn models, heads, trees and
batches; perfect drafts exercise long acceptance, full trees and max-token cutoffs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.runtime.config import SamplingParams
from specrun.runtime.reference import reference_generate
from specrun.runtime.speculative import speculative_generate
from specrun.runtime.tree import StaticTree, TreeShape
from tiny_models import TargetAsDraft, random_head, random_llama, tiny_config


@st.composite
def llama_configs(draw):
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 32, 64]))
    return tiny_config(
        vocab_size=draw(st.integers(32, 512)),
        num_layers=draw(st.integers(1, 3)),
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2])),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=draw(st.sampled_from([16, 32, 48])),
    )


@st.composite
def tree_shapes(draw):
    depth, topk = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    num_candidates = topk + (depth - 1) * topk**2
    num_nodes = draw(st.integers(1, min(64, num_candidates + 1)))
    # Stochastic trees draft greedy requests as deterministic ones do.
    return TreeShape(depth, topk, num_nodes, stochastic=draw(st.booleans()))


@st.composite
def static_trees(draw):
    """Random fixed trees: paths of child ranks (< 4), closed under prefixes."""
    frontier = [(rank,) for rank in range(draw(st.integers(1, 4)))]
    paths = list(frontier)
    for _ in range(draw(st.integers(0, 4))):
        frontier = [(*p, r) for p in frontier for r in range(draw(st.integers(0, 3)))]
        if not frontier or len(paths) + len(frontier) > 48:
            break
        paths += frontier
    return StaticTree.from_paths(paths)


def _prompts(draw, vocab: int) -> list[list[int]]:
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=8))
    return [draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)) for n in lengths]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    config=llama_configs(),
    shape=st.one_of(tree_shapes(), static_trees()),
    kind=st.sampled_from(["eagle1", "eagle3", "dense", "perfect"]),
    num_layers=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_greedy_speculative_equals_reference(data, config, shape, kind, num_layers, dtype):
    target = random_llama(config, seed=data.draw(st.integers(0, 99)), dtype=dtype)
    if kind == "perfect":
        head = TargetAsDraft(target)
    else:
        head = random_head(kind, target, num_layers=1 if kind == "eagle1" else num_layers)
    prompts = _prompts(data.draw, config.vocab_size)
    max_new = data.draw(st.lists(st.integers(0, 24), min_size=len(prompts), max_size=len(prompts)))
    params = [SamplingParams(max_new_tokens=n) for n in max_new]
    eos = data.draw(st.lists(st.integers(0, config.vocab_size - 1), max_size=2))
    with torch.no_grad():
        want = reference_generate(target, prompts, params, eos_token_ids=eos)
        got, _ = speculative_generate(target, head, prompts, params, shape=shape, eos_token_ids=eos)
    assert got == want


def test_greedy_speculation_with_a_two_layer_eagle3_head_equals_reference():
    shape = TreeShape(4, 3, 10)
    target = random_llama(tiny_config(vocab_size=61), seed=1, dtype=torch.float64)
    head = random_head("eagle3", target, seed=2, num_layers=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = [SamplingParams(max_new_tokens=n) for n in (12, 7, 16)]
    with torch.no_grad():
        want = reference_generate(target, prompts, params, eos_token_ids=[11])
        got, _ = speculative_generate(
            target, head, prompts, params, shape=shape, eos_token_ids=[11]
        )
    assert head.num_layers == 2 and got == want


@pytest.mark.parametrize(
    "shape",
    [
        TreeShape(4, 3, 10),
        TreeShape(8, 1, 9),
        TreeShape(6, 4, 40),
        StaticTree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0], [1, 0]]),
    ],
)
def test_perfect_draft_accepts_whole_paths(shape):
    target = random_llama(tiny_config(vocab_size=61, num_layers=2), dtype=torch.float64)
    with torch.no_grad():
        # A peaked target: its greedy chain has near-zero cumulative log-prob, so the rerank
        # keeps the whole chain and a perfect draft gets all D tokens accepted.
        target.lm_head.weight.mul_(30.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = SamplingParams(max_new_tokens=30)
    with torch.no_grad():
        want = reference_generate(target, prompts, params)
        got, stats = speculative_generate(
            target, TargetAsDraft(target), prompts, params, shape=shape
        )
    assert got == want
    assert [len(g.token_ids) for g in got] == [30] * 3
    # every slot-round except each slot's last (cut by max_new_tokens) accepts D tokens
    full_rounds = stats.accepted_histogram[shape.depth]
    assert full_rounds >= sum(stats.accepted_histogram) - len(prompts)


def test_stochastic_tree_accepts_every_draft_of_a_perfect_head(fresh_seeds):
    """A head equal to the target (at the request's temperature) has each first sampled child
    accepted: every round but each request's last takes all D tokens (unseeded requests:
    seeded ones never draft stochastically)."""
    target = random_llama(tiny_config(vocab_size=23, num_layers=1), seed=3, dtype=torch.float64)
    shape, prompts = TreeShape(3, 2, 6, stochastic=True), [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    params = SamplingParams(temperature=1.0, max_new_tokens=31)
    with torch.no_grad():
        got, stats = speculative_generate(
            target, TargetAsDraft(target), prompts, params, shape=shape
        )
    assert [len(g.token_ids) for g in got] == [31] * 3
    assert stats.accepted_histogram[shape.depth] >= sum(stats.accepted_histogram) - len(prompts)
    with torch.no_grad():
        _, fixed = speculative_generate(
            target, TargetAsDraft(target), prompts, params, shape=TreeShape(3, 2, 6)
        )
    assert stats.mean_accepted_length > fixed.mean_accepted_length + 0.5


def _exact_three_token_law(target, prompt, params) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of autoregressive sampling, by enumerating every prefix."""
    from specrun.runtime.sampling import SamplingTensors, target_probs

    vocab = target.config.vocab_size
    sampling = SamplingTensors.from_params([params], "cpu")

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        from specrun.models.attention import chain_ancestors
        from specrun.models.llama import AttentionInputs

        tokens = torch.tensor(prefixes)
        batch, length = tokens.shape
        cache = torch.zeros(target.config.num_layers, batch, target.config.num_kv_heads, 1, 8)
        attn = AttentionInputs(
            cache.double(),
            cache.double(),
            torch.zeros(batch, dtype=torch.int64),
            chain_ancestors(batch, length, "cpu"),
        )
        hidden = target(tokens, torch.arange(length).expand(batch, -1), attn).hidden[:, -1]
        per_slot = SamplingTensors(
            sampling.temperature.expand(batch),
            sampling.top_k.expand(batch),
            sampling.top_p.expand(batch),
        )
        return target_probs(target.logits(hidden), per_slot)

    law: dict[tuple[int, ...], float] = {}
    p1 = next_probs([prompt])[0]
    p2 = next_probs([[*prompt, a] for a in range(vocab)])
    for a in range(vocab):
        p3 = next_probs([[*prompt, a, b] for b in range(vocab)])
        for b in range(vocab):
            for c in range(vocab):
                law[(a, b, c)] = float(p1[a] * p2[a, b] * p3[b, c])
    return law


@pytest.mark.parametrize(
    ("kind", "params", "shape"),
    [
        ("perfect", SamplingParams(temperature=1.0, max_new_tokens=3), TreeShape(2, 2, 5)),
        ("eagle1", SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3), TreeShape(2, 3, 7)),
        (
            "perfect",
            SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=3),
            TreeShape(3, 2, 6),
        ),
        # Stochastic trees: sampled drafts, recursive rejection sampling.
        ("eagle3", SamplingParams(temperature=1.0, max_new_tokens=3), TreeShape(2, 3, 7, True)),
        (
            "eagle1",
            SamplingParams(temperature=0.8, top_k=6, max_new_tokens=3),
            TreeShape(3, 2, 6, True),
        ),
        ("perfect", SamplingParams(temperature=1.0, max_new_tokens=3), TreeShape(2, 4, 9, True)),
    ],
)
def test_speculative_sampling_is_lossless(kind, params, shape, fresh_seeds):
    from goodness_of_fit import chi_square_p_value

    target = random_llama(tiny_config(vocab_size=10, num_layers=1), seed=5, dtype=torch.float64)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)  # moderately peaked: drafts get accepted often
    head = TargetAsDraft(target) if kind == "perfect" else random_head(kind, target, seed=2)
    prompt, num_samples = [3, 1, 4], 15_000
    # Unseeded (seeded requests never draft stochastically), each with a fresh seed.
    with torch.no_grad():
        law = _exact_three_token_law(target, prompt, params)
        got, stats = speculative_generate(target, head, [prompt] * num_samples, params, shape=shape)
    counts: dict[tuple[int, ...], int] = {}
    for g in got:
        counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
    assert stats.mean_accepted_length > 1.2  # the tree is exercised, not just the bonus
    assert chi_square_p_value(counts, law, num_samples) > 1e-4
