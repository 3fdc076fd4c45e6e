"""The small-topk replacement: ATen topk with a small k over the last dimension becomes
`rt::topk` in compiled graphs.

It fires once per level of a static tree's draft phase (the root's children, then each level
below), for static and dynamic row counts, and the compiled draft equals eager; EAGLE-2 levels
select with `rt::log_softmax_topk` and leave it nothing; a topk the op does not take (another
dim, smallest, a large k, integers) is left alone. The GPU tier covers the op's
Triton kernels (tests/kernels/test_topk.py) and whole compiled rounds (tests/runtime).
"""

from __future__ import annotations

import copy

import pytest
import torch

from specrun.runtime.config import SamplingParams
from specrun.runtime.graphs import compile_step
from specrun.runtime.kernels.topk import MAX_K
from specrun.runtime.passes import PassManager
from specrun.runtime.passes.topk import SmallTopkReplacement
from specrun.runtime.round import draft_phase
from specrun.runtime.tree import StaticTree, TreeShape
from tiny_models import prefilled_state, random_head, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = pytest.mark.usefixtures("uncached_compiles")


def _compiled(fn, **kwargs):
    manager = PassManager([SmallTopkReplacement()])
    return compile_step(fn, name="topk_test", manager=manager, **kwargs), manager


def _compiled_draft_equals_eager(kind: str, shape: TreeShape | StaticTree):
    """Compile draft_phase for `shape`, check it against eager; returns the pass manager."""
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.float32)
    head = random_head(kind, target)
    params = SamplingParams(max_new_tokens=8)
    state = prefilled_state(target, head, shape, [[1, 2, 3], [4, 5]], params)[0]
    eager_state = copy.deepcopy(state)
    step, manager = _compiled(draft_phase)
    (got, _), (want, _) = step(head, state, shape), draft_phase(head, eager_state, shape)
    for name in ("tokens", "parent", "depth", "anc"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(state.draft.k, eager_state.draft.k)
    return manager


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_replaces_every_level_of_a_static_tree_draft_phase(kind):
    shape = StaticTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])
    manager = _compiled_draft_equals_eager(kind, shape)
    assert manager.stats["small_topk"] == shape.depth


def test_dynamic_tree_levels_select_with_the_fused_op():
    manager = _compiled_draft_equals_eager("eagle3", TreeShape(4, 3, 9))
    assert manager.stats["small_topk"] == 0


def test_dynamic_rows_are_replaced_and_equal_eager():
    def top_children(logits):
        return logits.float().log_softmax(-1).topk(5)

    def rows_dynamic(logits):
        torch._dynamo.mark_dynamic(logits, 0)

    step, manager = _compiled(top_children, mark_dynamic=rows_dynamic)
    for num_rows in (3, 7):
        logits = torch.randn(num_rows, 2, 300)
        got, want = step(logits), top_children(logits)
        torch.testing.assert_close(got.values, want.values)
        assert torch.equal(got.indices, want.indices)
    assert manager.stats["small_topk"] == step.num_compiles == 1


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda x: x.topk(3, dim=0), id="first-dim"),
        pytest.param(lambda x: x.topk(3, largest=False), id="smallest"),
        pytest.param(lambda x: x.topk(MAX_K + 1), id="large-k"),
        pytest.param(lambda x: x.long().topk(3), id="integers"),
    ],
)
def test_calls_the_op_does_not_take_are_left_alone(call):
    x = torch.randn(4, 200)
    step, manager = _compiled(call)
    got, want = step(x), call(x)
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    assert manager.stats["small_topk"] == 0
