"""Fusion pass: a SwiGLU MLP's gate/up product and its SiLU(gate) * up -> `rt::mm_silu_mul`.

`MLP.forward` (models/llama.py) computes `F.silu(gate) * up` on the halves of one fused
gate/up product; after the skinny-mm pass, in the post-grad graph of a half-precision model,
that is

    gate_up = rt::skinny_mm(x [M, H], w [2I, H])
    gate, up = split_with_sizes(view(gate_up, [..., 2I]), [I, I], -1)
    g = convert_element_type(gate, float32)
    silu = convert_element_type(div(g, add(exp(neg(g)), 1)), half)   (or mul(g, sigmoid(g)))
    out = mul(silu, up)                                               [..., I]

This pass swaps `out` for `view(rt::mm_silu_mul(x, w), [..., I])` where every intermediate
is used only as written (the product, its halves and the SiLU feed nothing else): the
element-wise kernel and the [M, 2I] product's round trip go. It runs after the skinny-mm
pass, so it fuses only the products that pass made (its devices and dtypes); dead-code
elimination drops the rest. runtime/kernels/mm_silu_mul.py says what the op computes.
"""

from __future__ import annotations

import torch
from torch import fx

from ..kernels import mm_silu_mul as silu_kernel
from .fx_match import (
    RESHAPES,
    aten,
    copy_source_meta,
    getitem_of,
    in_fake_mode,
    is_call,
    is_dim,
    prims,
    scalar_value,
    tensor_val,
)
from .manager import GraphPass


class SiluMulFusion(GraphPass):
    """Fuse every gate/up product whose only use is SiLU(gate) * up; returns the number
    fused."""

    name = "mm_silu_mul"
    version = 1

    def __call__(self, graph: fx.Graph) -> int:
        matches = [(n, m) for n in graph.nodes if (m := match_silu_mul(n)) is not None]
        for node, (x, w) in matches:
            _fuse(graph, node, x, w)
        return len(matches)


def match_silu_mul(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(x, w) if `node` is SiLU(gate) * up of the halves of an `rt::skinny_mm(x, w)` product
    used by nothing else; else None."""
    if not is_call(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for silu, up in (node.args, node.args[::-1]):
        gate = _silu_input(silu)
        if gate is None:
            continue
        split = getitem_of(gate, 0)
        if split is None or getitem_of(up, 1) is not split or len(up.users) != 1:
            continue
        product = _split_source(split)
        if product is not None:
            return product.args[0], product.args[1]
    return None


def _silu_input(node: fx.Node) -> fx.Node | None:
    """x for convert(silu(convert(x, float32)), x.dtype), each step used only here, with
    silu as div(g, add(exp(neg(g)), 1)) or mul(g, sigmoid(g)); else None."""
    if not is_call(node, prims.convert_element_type.default) or len(node.users) != 1:
        return None
    inner = node.args[0]
    if not isinstance(inner, fx.Node) or len(inner.users) != 1:
        return None
    if is_call(inner, aten.div.Tensor):
        upcast, denominator = inner.args
        ok = (
            is_call(denominator, aten.add.Tensor, aten.add.Scalar)
            and scalar_value(denominator.args[1]) == 1.0
            and denominator.kwargs.get("alpha", 1) == 1
            and is_call(denominator.args[0], aten.exp.default)
            and is_call(denominator.args[0].args[0], aten.neg.default)
            and denominator.args[0].args[0].args[0] is upcast
        )
    elif is_call(inner, aten.mul.Tensor):
        upcast, sigmoid = inner.args
        ok = is_call(sigmoid, aten.sigmoid.default) and sigmoid.args[0] is upcast
    else:
        return None
    if not ok or not is_call(upcast, prims.convert_element_type.default):
        return None
    gate = upcast.args[0]
    gate_val, out_val = tensor_val(gate), tensor_val(node)
    if gate_val is None or out_val is None or upcast.args[1] != torch.float32:
        return None
    if len(gate.users) != 1:
        return None
    # The upcast feeds the SiLU's two uses of g and nothing else.
    return gate if out_val.dtype == gate_val.dtype and len(upcast.users) == 2 else None


def _split_source(split: fx.Node) -> fx.Node | None:
    """The `rt::skinny_mm` node that `split` halves along its last dim (through views), each
    step used only here; else None."""
    if not is_call(split, aten.split_with_sizes.default) or len(split.users) != 2:
        return None
    source, sizes = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    shape = tensor_val(source).shape if tensor_val(source) is not None else None
    if shape is None or not is_dim(dim, -1, len(shape)) or len(sizes) != 2:
        return None
    if not (isinstance(sizes[0], int) and sizes[0] == sizes[1]):
        return None
    if len(source.users) != 1:
        return None
    while is_call(source, *RESHAPES) and len(source.users) == 1:
        source = source.args[0]
    if not is_call(source, torch.ops.rt.skinny_mm.default) or len(source.users) != 1:
        return None
    return source


def _fuse(graph: fx.Graph, node: fx.Node, x: fx.Node, w: fx.Node) -> None:
    out_shape = list(tensor_val(node).shape)
    with graph.inserting_before(node):
        fused = graph.call_function(torch.ops.rt.mm_silu_mul.default, (x, w))
        view = graph.call_function(aten.view.default, (fused, out_shape))
    x_val, w_val = tensor_val(x), tensor_val(w)
    with in_fake_mode([x_val]):
        fused.meta["val"] = silu_kernel.mm_silu_mul(x_val, w_val)
        view.meta["val"] = fused.meta["val"].view(out_shape)
    copy_source_meta(node, fused)
    node.replace_all_uses_with(view)
    graph.erase_node(node)
