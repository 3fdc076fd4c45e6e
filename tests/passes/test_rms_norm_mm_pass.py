"""The norm-prologue fusion: a residual add, its RMSNorm and the few-row product that reads the
norm become one `rt::add_rms_norm_mm` (or `..._silu_mul`).

It fires twice per layer of a few-row target forward but once in the first layer (whose input
norm reads the embedding, not a sum), the compiled forward equals eager (to bf16 rounding),
it fuses the `_fused_rms_norm` form of the graph as well as the decomposed one, and only
products of at most `max_rows` rows (one by default). The tests build the
skinny-mm pass for "cpu" (the ops run their references there); `test_default_passes.py` runs
the fusion on the GPU, where the ops launch their Triton kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from specrun.runtime.graphs import compile_verify
from specrun.runtime.passes import PassManager
from specrun.runtime.passes.mm_silu_mul import SiluMulFusion
from specrun.runtime.passes.rms_norm_mm import NormPrologueFusion
from specrun.runtime.passes.skinny_mm import SkinnyMMReplacement
from tiny_models import assert_step_close, chained_step_inputs, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = pytest.mark.usefixtures("uncached_compiles")


def _compiled_step(target, *, silu_mul=True, device_types=("cpu",), max_rows=16):
    passes = [SkinnyMMReplacement(device_types=device_types)]
    passes += [SiluMulFusion()] if silu_mul else []
    manager = PassManager([*passes, NormPrologueFusion(max_rows=max_rows)])
    return compile_verify(target, manager=manager), manager


@pytest.mark.parametrize(
    ("batch", "num_tokens", "silu_mul"), [(1, 1, True), (2, 8, True), (1, 1, False)]
)
def test_fuses_every_norm_but_the_first_and_last_and_matches_eager(batch, num_tokens, silu_mul):
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.bfloat16)
    step, manager = _compiled_step(target, silu_mul=silu_mul)
    inputs = chained_step_inputs(
        target.config, batch=batch, num_tokens=num_tokens, dtype=torch.bfloat16
    )
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    assert manager.stats["rms_norm_mm"] == 2 * target.config.num_layers - 1


def test_leaves_products_without_rt_skinny_mm_alone():
    torch.manual_seed(0)
    target = random_llama(tiny_config(num_layers=1), dtype=torch.bfloat16)
    step, manager = _compiled_step(target, device_types=("cuda",))
    inputs = chained_step_inputs(target.config, batch=1, num_tokens=1, dtype=torch.bfloat16)
    assert_step_close(step(*inputs), target(*inputs), atol=2e-2, rtol=2e-2)
    assert manager.stats["rms_norm_mm"] == 0


def _fused_norm_graph(depth, *, h_used_first=False, norm_used_twice=False):
    """A graph of h = x + delta; rt::skinny_mm(weight * _fused_rms_norm(h)) with h used again
    (before or after the product), in ATen ops with fake values as a post-grad graph has
    them; its arguments and its eager outputs."""
    aten = torch.ops.aten

    def body(x, delta, weight, w):
        h = aten.add.Tensor(x, delta)
        early = aten.mul.Tensor(h, 2) if h_used_first else None
        normed = aten._fused_rms_norm.default(h, [depth], None, 1e-5)[0]
        scaled = aten.mul.Tensor(weight, normed)
        out = torch.ops.rt.skinny_mm.default(aten.view.default(scaled, [-1, depth]), w)
        extra = aten.mul.Tensor(scaled, 3) if norm_used_twice else None
        return out, aten.add.Tensor(h, 1), early, extra

    gen = torch.Generator().manual_seed(0)
    args = [
        torch.randn(1, 3, depth, generator=gen),
        torch.randn(1, 3, depth, generator=gen),
        1 + 0.1 * torch.randn(depth, generator=gen),
        torch.randn(40, depth, generator=gen) * depth**-0.5,
    ]
    args = [a.to(torch.bfloat16) for a in args]
    module = fx.symbolic_trace(body)
    with FakeTensorMode() as mode:
        FakeTensorProp(module, mode).propagate(*[mode.from_tensor(a) for a in args])
    return module, args, body(*args)


def test_fuses_the_fused_rms_norm_form():
    module, args, want = _fused_norm_graph(64)
    assert any(n.target == torch.ops.aten._fused_rms_norm.default for n in module.graph.nodes)
    assert NormPrologueFusion(max_rows=3)(module.graph) == 1
    module.graph.eliminate_dead_code()
    module.recompile()
    got = module(*args)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    assert not any(n.target == torch.ops.aten._fused_rms_norm.default for n in module.graph.nodes)


@pytest.mark.parametrize(
    ("depth", "max_rows", "options"),
    [
        (64, 2, {}),  # 3 rows, more than max_rows
        (64, None, {}),  # 3 rows, more than the default one
        (2048, 3, {}),  # rows too long: every program would re-read them
        (64, 3, {"h_used_first": True}),  # h read before the product runs
        (64, 3, {"norm_used_twice": True}),  # the normed rows have another use
    ],
)
def test_leaves_other_graphs_alone(depth, max_rows, options):
    module, _, _ = _fused_norm_graph(depth, **options)
    fusion = NormPrologueFusion() if max_rows is None else NormPrologueFusion(max_rows=max_rows)
    assert fusion(module.graph) == 0


@pytest.mark.parametrize(
    ("max_rows", "error"), [(0, ValueError), (1.5, TypeError), ("2", TypeError), (True, TypeError)]
)
def test_rejects_bad_max_rows(max_rows, error):
    with pytest.raises(error, match="max_rows"):
        NormPrologueFusion(max_rows=max_rows)


def test_max_rows_is_part_of_the_cache_key():
    keys = {PassManager([NormPrologueFusion(max_rows=n)]).uuid() for n in (1, 1, 16)}
    assert len(keys) == 2
