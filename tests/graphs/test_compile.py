"""compile_step on the whole speculative round, and its recompilation bound.

The round (draft extend, tree expansion with side buffers, verify, accept, commit) compiles
with Inductor as one graph (fullgraph=True); the tree-attention pass fuses every attention of
the draft and the target; two compiled rounds equal two eager rounds exactly (float64, greedy)
and the second round reuses the first round's graph. A step that keeps recompiling raises.
Steps run without autograd even when the caller has grad enabled and the weights require grad
(`specrun bench decode` compiles its draft phase that way).
"""

from __future__ import annotations

import copy

import pytest
import torch

from specrun.runtime.config import SamplingParams
from specrun.runtime.graphs import compile_round, compile_step
from specrun.runtime.kv_cache import KVCache
from specrun.runtime.passes import PassManager
from specrun.runtime.passes.manager import GraphPass
from specrun.runtime.round import ReportColumns, draft_phase, speculative_round
from specrun.runtime.tree import TreeShape
from tiny_models import TargetAsDraft, prefilled_state, random_head, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = pytest.mark.usefixtures("uncached_compiles")


def _state(target, head, shape):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    return prefilled_state(target, head, shape, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], params)[0]


def _assert_same_state(got, want, **tolerance):
    for name in ("output", "num_output", "root", "done", "finish"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for cache in ("target", "draft"):
        got_cache, want_cache = getattr(got, cache), getattr(want, cache)
        assert torch.equal(got_cache.lengths, want_cache.lengths), cache
        torch.testing.assert_close(got_cache.k, want_cache.k, **tolerance)
        torch.testing.assert_close(got_cache.v, want_cache.v, **tolerance)


def test_round_compiles_once_fuses_every_attention_and_matches_eager():
    """The target drafts for itself (TargetAsDraft), so rounds accept draft tokens and commit
    several K/V entries per slot: every path of the round runs."""
    _check_compiled_rounds(random_llama(tiny_config(), dtype=torch.float64))


@pytest.mark.gpu
def test_gpu_round_compiles_with_the_triton_op_and_matches_eager():
    """float32 on CUDA: the fused op is the Triton kernel (head dim 16, as it requires)."""
    target = random_llama(tiny_config(head_dim=16), dtype=torch.float32).cuda()
    _check_compiled_rounds(target, atol=1e-4, rtol=1e-4)


def _check_compiled_rounds(target, **tolerance):
    head = TargetAsDraft(target)
    shape = TreeShape(2, 2, 4)
    eager = _state(target, head, shape)
    compiled = copy.deepcopy(eager)
    step = compile_round(speculative_round)
    num_accepted = 0
    for round_index in range(2):
        with torch._dynamo.config.patch(error_on_recompile=round_index > 0):
            got = step(target, head, compiled, shape)
        want = speculative_round(target, head, eager, shape)
        assert torch.equal(got, want)
        _assert_same_state(compiled, eager, **tolerance)
        num_accepted += want[:, ReportColumns.NUM_ACCEPTED]
    assert step.num_compiles == 1
    assert (num_accepted > 0).all()
    # The draft head attends once per layer at extend and at each of depth - 1 expansions.
    num_attention = head.num_layers * shape.depth + target.config.num_layers
    fusion = step.manager.passes[0]
    assert not fusion.num_unfused_by_reason, dict(fusion.num_unfused_by_reason)
    assert step.manager.stats["tree_attention"] == num_attention, dict(fusion.num_fused_by_form)


def test_recompiles_are_bounded_and_config_is_left_alone():
    step = compile_step(lambda x: x * 2, name="double", recompile_limit=1)
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        step(torch.ones(3))
    assert step.num_compiles == 1
    assert torch._inductor.config.post_grad_custom_post_pass is None


class _ConfigAtCompile(GraphPass):
    """Records Inductor's shape_padding as the post-grad passes see it."""

    name = "config_at_compile"

    def __call__(self, graph):
        self.shape_padding = torch._inductor.config.shape_padding
        return 0


def test_steps_compile_without_shape_padding():
    """Inductor's pad_mm would time padded against unpadded products while compiling: steps
    compile with it off (the same graph every run), and the process's config is untouched."""
    recorder = _ConfigAtCompile()
    step = compile_step(lambda x: x + 1, name="add_one", manager=PassManager([recorder]))
    assert torch.equal(step(torch.ones(5)), torch.full((5,), 2.0))
    assert recorder.shape_padding is False
    assert torch._inductor.config.shape_padding is True


def _triple(x):
    return x * 3


def test_steps_of_one_function_do_not_share_a_recompile_budget():
    """Dynamo keeps graphs per code object: a second step of the same function (a second
    Decoder's round) gets its own graphs on top of the first step's."""
    first = compile_step(_triple, name="first", recompile_limit=2)
    for size in (2, 3):
        first(torch.ones(size))
    second = compile_step(_triple, name="second", recompile_limit=1)
    assert torch.equal(second(torch.ones(4)), torch.full((4,), 3.0))
    assert (first.num_compiles, second.num_compiles) == (2, 1)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        second(torch.ones(5))


def _append_step(weight, cache, x):
    """Appends weight-derived K/V (they need grad outside no_grad) to a KV cache."""
    k_new = (x @ weight).view(1, 3, 2, 1, 4)
    cache.append(k_new, -k_new, torch.ones_like(cache.lengths))
    return cache.lengths * 2


def _cache() -> KVCache:
    k, v = torch.zeros(1, 3, 2, 5, 4), torch.zeros(1, 3, 2, 5, 4)
    return KVCache(k, v, torch.tensor([0, 2, 1]))


def test_a_step_called_with_grad_enabled_mutates_its_state_exactly_like_eager():
    """Grad enabled by the caller: a step traced as a training graph by AOTAutograd would copy
    the mutated lengths [3] into the K cache [..., 4] ("The size of tensor a (4) must match the
    size of tensor b (3)"), as `bench decode`'s draft phase would at batch 8, head dim 128."""
    weight = torch.nn.Parameter(torch.randn(5, 8, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    compiled, eager = _cache(), _cache()
    step = compile_step(_append_step, name="append")
    with torch.enable_grad():
        got = step(weight, compiled, x)
    want = _append_step(weight, eager, x)
    assert torch.equal(got, want) and not got.requires_grad
    for name in ("k", "v", "lengths"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name


def test_draft_phase_compiled_with_grad_enabled_matches_eager():
    """The same for an EAGLE-3 head's draft phase (extend, expansion, rerank) compiled outside
    inference mode, batch 3 != head dim 8."""
    target = random_llama(tiny_config(), dtype=torch.float64)
    head = random_head("eagle3", target)
    shape = TreeShape(2, 2, 3)
    eager = _state(target, head, shape)
    compiled = copy.deepcopy(eager)
    with torch.enable_grad():
        got, _ = compile_step(draft_phase, name="draft_phase")(head, compiled, shape)
    want, _ = draft_phase(head, eager, shape)
    for name in ("tokens", "parent", "depth", "anc"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(compiled.draft.lengths, eager.draft.lengths)
    torch.testing.assert_close(compiled.draft.k, eager.draft.k)
    torch.testing.assert_close(compiled.draft.v, eager.draft.v)


def _append_three(cache: KVCache, k_new: torch.Tensor, num_new: torch.Tensor) -> None:
    cache.append(k_new, -k_new, num_new)


def test_a_compiled_kv_append_writes_into_the_cache_in_place():
    """A scatter_ into the cache (a graph input) compiled to a copy of the whole cache,
    scattered, then copied back, every step; the append must allocate nothing cache-sized."""
    from torch._inductor.utils import run_and_get_code

    config, capacity = tiny_config(), 1031
    caches = [
        KVCache.allocate(config, batch_size=4, capacity=capacity, dtype=torch.float32, device="cpu")
        for _ in range(2)
    ]
    # Slots of a larger store, as the decoder's buckets are.
    compiled, eager = (KVCache(c.k[:, :3], c.v[:, :3], c.lengths[:3]) for c in caches)
    for cache in (compiled, eager):
        cache.lengths.copy_(torch.tensor([0, 7, capacity - 5]))
    shape = (config.num_layers, 3, config.num_kv_heads, 5, config.head_dim)
    k_new = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    num_new = torch.tensor([5, 2, 0])
    step = compile_step(_append_three, name="append")
    _, sources = run_and_get_code(step, compiled, k_new, num_new)
    _append_three(eager, k_new, num_new)
    for name in ("k", "v", "lengths"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    allocations = [
        line for source in sources for line in source.splitlines()
        if "empty_strided" in line and str(capacity) in line
    ]  # fmt: skip
    assert not allocations, allocations


def test_a_compiled_stochastic_round_takes_every_draft_of_a_perfect_head(fresh_seeds):
    """Stochastic trees under compile, greedy and sampling rows in one batch: the rows that
    sample (T = 1) accept all D sampled drafts of the near-perfect head, and every row reports
    what the eager round reports. Unseeded requests (seeded ones never draft stochastically)
    with reproducible fresh seeds: the head misses the first prompt token, so an unlucky
    draw could reject a draft."""
    target = random_llama(tiny_config(), dtype=torch.float64)
    head = TargetAsDraft(target)
    shape = TreeShape(3, 2, 6, stochastic=True)
    params = [SamplingParams(max_new_tokens=12, temperature=t) for t in (1.0, 0.0, 1.0)]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    eager = prefilled_state(target, head, shape, prompts, params, eos_token_ids=())[0]
    compiled = copy.deepcopy(eager)
    step = compile_round(speculative_round)
    for _ in range(2):
        got = step(target, head, compiled, shape)
        want = speculative_round(target, head, eager, shape)
        assert got[:, ReportColumns.NUM_ACCEPTED].tolist()[::2] == [shape.depth] * 2
        assert torch.equal(got, want)
    assert step.num_compiles == 1
