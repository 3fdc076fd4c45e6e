"""FusedLinear: one GEMM for several projections, stored as the separate projections.

Its parts must equal separate Linears holding the same rows (odd sizes, with and without
bias); with `store_parts_separately` on its parent, `state_dict()` must hold only the parts'
names (siblings of the fused module), in the shapes and values of those rows;
`load_state_dict()` must accept exactly that layout and refuse an incomplete one;
`part_slices` must say where each part's rows live.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specrun.models.fused_linear import FusedLinear, part_slices, store_parts_separately

PARTS = {"q_proj": 5, "k_proj": 3, "v_proj": 3}


class Block(nn.Module):
    def __init__(self, *, bias: bool) -> None:
        super().__init__()
        self.qkv_proj = FusedLinear(7, PARTS, bias=bias)
        self.o_proj = nn.Linear(5, 7, bias=bias)
        store_parts_separately(self)


class Model(nn.Module):
    def __init__(self, *, bias: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(bias=bias) for _ in range(2))


@pytest.mark.parametrize("bias", [False, True])
def test_parts_equal_separate_projections(bias):
    torch.manual_seed(0)
    fused = FusedLinear(7, PARTS, bias=bias)
    x = torch.randn(2, 3, 7)
    start = 0
    for out, size in zip(fused(x), PARTS.values(), strict=True):
        separate = nn.Linear(7, size, bias=bias)
        with torch.no_grad():
            separate.weight.copy_(fused.weight[start : start + size])
            if bias:
                separate.bias.copy_(fused.bias[start : start + size])
        assert out.shape == (2, 3, size)
        torch.testing.assert_close(out, separate(x))
        start += size


@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_holds_the_parts_and_loads_back(bias):
    torch.manual_seed(1)
    model = Model(bias=bias)
    state = model.state_dict()
    suffixes = ("weight", "bias") if bias else ("weight",)
    want = {
        f"blocks.{i}.{name}.{suffix}"
        for i in range(2)
        for name in (*PARTS, "o_proj")
        for suffix in suffixes
    }
    assert set(state) == want
    fused = model.blocks[1].qkv_proj
    assert torch.equal(state["blocks.1.k_proj.weight"], fused.weight[5:8])
    assert state["blocks.1.v_proj.weight"].shape == (3, 7)
    fresh = Model(bias=bias)
    fresh.load_state_dict({name: t.clone() for name, t in state.items()})
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_an_incomplete_layout_is_refused():
    state = Model(bias=False).state_dict()
    del state["blocks.0.v_proj.weight"]
    with pytest.raises(RuntimeError, match=r"blocks\.0\.qkv_proj\.weight"):
        Model(bias=False).load_state_dict(state)


def test_part_slices_locate_every_part():
    model = Model(bias=True)
    slices = part_slices(model)
    state = model.state_dict()
    assert set(slices) == {name for name in state if "o_proj" not in name}
    for part, (fused_name, rows) in slices.items():
        assert torch.equal(state[part], model.get_parameter(fused_name)[rows])
    assert part_slices(FusedLinear(4, {"a": 1, "b": 2}, bias=False)) == {
        "a.weight": ("weight", slice(0, 1)),
        "b.weight": ("weight", slice(1, 3)),
    }
