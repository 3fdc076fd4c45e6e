"""A round is one host-sync-free graph: it traces with fullgraph=True and equals eager (its
report, tokens and lengths exactly; its caches up to float64 rounding)."""

from __future__ import annotations

import copy

import pytest
import torch

from specrun.runtime.config import SamplingParams
from specrun.runtime.round import ReportColumns, speculative_round
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, prefilled_state, random_head, random_llama, tiny_config


def _fresh_state(target, head, shape, params):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    return prefilled_state(target, head, shape, prompts, params)[0]


@pytest.mark.parametrize(
    ("kind", "temperature", "num_layers"),
    [
        ("eagle1", 0.8, 1),
        ("eagle3", 0.0, 1),
        ("eagle3", 0.8, 2),
        ("dense", 0.8, 1),
        ("perfect", 0.0, 1),
        ("perfect", 0.3, 1),
    ],
)
def test_round_traces_without_graph_breaks_and_matches_eager(kind, temperature, num_layers):
    torch._dynamo.reset()
    target = random_llama(tiny_config(), dtype=torch.float64)
    if kind == "perfect":
        head = TargetAsDraft(target)
    else:
        head = random_head(kind, target, num_layers=num_layers)
    shape = TreeShape(3, 2, 6)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=20, top_p=0.9, seed=7)
    with torch.no_grad():
        eager_state = _fresh_state(target, head, shape, params)
        compiled_state = copy.deepcopy(eager_state)
        compiled = torch.compile(speculative_round, fullgraph=True, backend="eager")
        for _ in range(2):
            want = speculative_round(target, head, eager_state, shape)
            got = compiled(target, head, compiled_state, shape)
            assert torch.equal(got, want)
            if kind == "perfect":  # the target as its draft: the rounds accept draft tokens
                assert bool((want[:, ReportColumns.NUM_ACCEPTED] > 0).any()), want
    assert torch.equal(compiled_state.output, eager_state.output)
    assert torch.equal(compiled_state.target.lengths, eager_state.target.lengths)
    # Eager CPU attention reads only the slots' lengths of cache (models/attention.py), the
    # traced graph the whole buffer under a mask: the same values up to float64 rounding.
    torch.testing.assert_close(compiled_state.draft.k, eager_state.draft.k, rtol=1e-12, atol=1e-12)
