"""Per-request random numbers (runtime/rng.py): a seeded request samples the same tokens alone,
in any batch and at any slot, with or without speculation, exactly the reference decoder's
tokens (seeded requests never draft stochastic trees, whose accepted tokens depend on the
tree), and decoding never reads or advances torch's generators."""

from __future__ import annotations

import pytest
import torch

from specrun.runtime.config import SamplingParams
from specrun.runtime.reference import reference_generate
from specrun.runtime.rng import Site, seed_halves, uniform
from specrun.runtime.speculative import speculative_generate
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, random_head, random_llama, tiny_config

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(), dtype=torch.float64)


def _seeds(*seeds: int) -> torch.Tensor:
    return torch.tensor([seed_halves(s) for s in seeds], dtype=torch.int64)


def test_uniforms_are_keyed_by_seed_counter_site_and_element():
    seed, counter = _seeds(1, 1, 2**40 + 1, 2), torch.tensor([5, 5, 5, 6])
    u = uniform(seed, counter, (4096,), site=Site.TARGET)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[0], u[1])  # same key, same numbers
    for other in (u[2], u[3], uniform(seed, counter, (4096,), site=Site.DRAFT)[0]):
        assert float((other == u[0]).float().mean()) < 0.01  # the high seed half counts too
    pooled = uniform(
        _seeds(*range(64)), torch.zeros(64, dtype=torch.int64), (4096,), site=Site.TARGET
    )
    assert abs(float(pooled.mean()) - 0.5) < 0.005 and abs(float(pooled.var()) - 1 / 12) < 0.002


@pytest.mark.parametrize(
    ("kind", "shape"),
    [
        ("perfect", TreeShape(3, 2, 6)),
        ("eagle3", TreeShape(2, 3, 7)),
        ("eagle1", TreeShape(3, 2, 6, stochastic=True)),
        ("plain", None),
    ],
)
def test_a_seeded_request_samples_the_same_tokens_alone_and_in_any_batch(target, kind, shape):
    head = None
    if kind != "plain":
        head = TargetAsDraft(target) if kind == "perfect" else random_head(kind, target)
    params = [
        SamplingParams(temperature=t, top_p=p, max_new_tokens=16, seed=s, ignore_eos=True)
        for t, p, s in ((1.0, 1.0, 3), (0.7, 0.9, 2**63 + 5), (0.0, 1.0, None), (1.3, 1.0, 11))
    ]

    def decode(prompts, requests):
        with torch.no_grad():
            if head is None:
                return [g.token_ids for g in reference_generate(target, prompts, requests)]
            got, _ = speculative_generate(target, head, prompts, requests, shape=shape)
            return [g.token_ids for g in got]

    alone = [decode([prompt], [p])[0] for prompt, p in zip(PROMPTS, params, strict=True)]
    order = [3, 0, 2, 1]
    batched = decode([PROMPTS[i] for i in order], [params[i] for i in order])
    assert [batched[order.index(i)] for i in range(4)] == alone
    if shape is not None:  # seeded requests walk the target's draws even on stochastic trees
        with torch.no_grad():
            want = reference_generate(target, PROMPTS, params)
        assert alone == [w.token_ids for w in want]


def test_decoding_leaves_torch_generators_alone_and_unseeded_requests_differ(target):
    head = random_head("eagle3", target)
    state = torch.get_rng_state()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    with torch.no_grad():
        got, _ = speculative_generate(
            target, head, [PROMPTS[0]] * 2, params, shape=TreeShape(2, 2, 4)
        )
    assert torch.equal(torch.get_rng_state(), state)
    assert got[0].token_ids != got[1].token_ids  # fresh seeds: 24 draws from 97 tokens
