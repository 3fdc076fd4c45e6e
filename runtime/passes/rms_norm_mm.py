"""Fusion pass: a residual add, its RMSNorm and the few-row product that reads the norm ->
`rt::add_rms_norm_mm` / `rt::add_rms_norm_mm_silu_mul`.

`DecoderLayer.forward` (models/llama.py) adds each sublayer's output to the residual stream
and normalises the sum for the next projection. After the skinny-mm and SiLU passes, in the
post-grad graph of a half-precision model, that is

    h = add(x, delta)                                        [..., K], also the stream's next x
    c = convert_element_type(h, float32)
    normed = mul(weight, convert_element_type(mul(c, rsqrt(add(mean(pow(c, 2), [-1], True),
                 eps))), half))                (or getitem(_fused_rms_norm(h, [K], None, eps), 0))
    out = rt::skinny_mm(view(normed, [M, K]), w)             (or rt::mm_silu_mul)

This pass swaps `out` for the fused op's product and every other use of h for its second
output, where the norm's steps are used only as written and h's other users come after the
product (the fused op runs where the product ran). Each layer's attention input norm (but
the first layer's, which normalises the embedding, not a sum) and its MLP norm fuse; the
final norm feeds no product and stays.

Every program of the fused product re-reads x and delta for its rows' norms before its K
loop (rms_norm_mm.py in runtime/kernels), so only short inputs fuse: rows of fewer than 2048
columns, and by default one row (a batch-1 decode step), where the product multiplies
elementwise. On an H200 at SmolLM2-135M's shapes that takes a step from 0.698 to 0.647 ms;
fusing the 8-row draft levels as well made a speculative round 2.5% slower (their
tensor-core tiles of 16 rows pay more for the pre-pass than the norm's launch costs).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..kernels import rms_norm_mm as kernel
from .fx_match import (
    RESHAPES,
    aten,
    copy_source_meta,
    getitem_of,
    in_fake_mode,
    is_call,
    is_last_dims,
    kwargs_of,
    prims,
    scalar_value,
    tensor_val,
)
from .manager import GraphPass

# Rows at least this long stay unfused (each program re-reads the [M, K] inputs).
MAX_COLUMNS = 2048
# The product -> the fused op and its Python entry (run on fake tensors for the metadata).
_FUSED = {
    torch.ops.rt.skinny_mm.default: (torch.ops.rt.add_rms_norm_mm.default, kernel.add_rms_norm_mm),
    torch.ops.rt.mm_silu_mul.default: (
        torch.ops.rt.add_rms_norm_mm_silu_mul.default,
        kernel.add_rms_norm_mm_silu_mul,
    ),
}


@dataclass(frozen=True)
class NormPrologueMatch:
    """A product whose input is weight * rms_norm(h) with h = x + delta; `chain` holds the
    nodes from h's upcast (or the fused norm) to the product's input, which die with it."""

    product: fx.Node
    h: fx.Node
    weight: fx.Node
    eps: float
    chain: tuple[fx.Node, ...]


class NormPrologueFusion(GraphPass):
    """Fuse every residual add and RMSNorm into the few-row product that reads them; returns
    the number fused.

    Args:
        max_rows: the most rows of x a fused product may have.
    """

    name = "rms_norm_mm"
    version = 1

    def __init__(self, *, max_rows: int = 1) -> None:
        if not isinstance(max_rows, int) or isinstance(max_rows, bool):
            raise TypeError(f"max_rows must be an int, got {type(max_rows).__name__}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.max_rows = max_rows

    def options(self) -> dict[str, object]:
        return {"max_rows": self.max_rows}

    def __call__(self, graph: fx.Graph) -> int:
        num_fused = 0
        # One at a time: a fusion rewrites the next one's x (the stream's h) to its output.
        for node in list(graph.nodes):
            match = match_norm_prologue(node, max_rows=self.max_rows)
            if match is not None:
                _fuse(graph, match)
                num_fused += 1
        return num_fused


def match_norm_prologue(node: fx.Node, *, max_rows: int) -> NormPrologueMatch | None:
    """The match if `node` is an `rt::skinny_mm` or `rt::mm_silu_mul` of at most `max_rows`
    rows of a residual add's RMSNorm as the module docstring writes it; else None."""
    if not any(is_call(node, target) for target in _FUSED):
        return None
    num_rows = tensor_val(node).shape[0] if tensor_val(node) is not None else None
    if not isinstance(num_rows, int) or num_rows > max_rows:
        return None
    chain = [node.args[0]]
    while is_call(chain[-1], *RESHAPES) and len(chain[-1].users) == 1:
        chain.append(chain[-1].args[0])
    scaled = chain[-1]
    if not is_call(scaled, aten.mul.Tensor) or len(scaled.users) != 1:
        return None
    for weight, normed in (scaled.args, scaled.args[::-1]):
        found = _rms_norm_of(normed)
        if found is None or not _is_norm_weight(weight, normed):
            continue
        h, eps, steps = found
        if not _is_residual_add(h) or tensor_val(h).dtype != tensor_val(normed).dtype:
            return None
        if not _users_come_after(h, set(steps), node):
            return None
        return NormPrologueMatch(node, h, weight, eps, tuple(chain + steps))
    return None


def _rms_norm_of(normed: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """(h, eps, the norm's nodes from `normed` back) for rms_norm(h) in either graph form,
    each step used only here; else None."""
    if not isinstance(normed, fx.Node) or len(normed.users) != 1:
        return None
    fused = getitem_of(normed, 0)
    if fused is not None:
        if not is_call(fused, aten._fused_rms_norm.default) or len(fused.users) != 1:
            return None
        args = kwargs_of(fused) or {}
        eps = args.get("eps")
        if args.get("weight") is not None or not isinstance(eps, float):
            return None
        if len(args.get("normalized_shape", ())) != 1:
            return None
        return args["input"], eps, [normed, fused]
    if not is_call(normed, prims.convert_element_type.default):
        return None
    scaled = normed.args[0]
    if not is_call(scaled, aten.mul.Tensor) or len(scaled.users) != 1:
        return None
    for upcast, rsqrt in (scaled.args, scaled.args[::-1]):
        is_upcast = is_call(upcast, prims.convert_element_type.default)
        if not is_upcast or upcast.args[1] != torch.float32:
            continue
        found = _mean_square_rsqrt(rsqrt, upcast)
        if found is None or len(upcast.users) != 2:
            continue
        eps, steps = found
        return upcast.args[0], eps, [normed, scaled, *steps, upcast]
    return None


def _mean_square_rsqrt(rsqrt: fx.Node, upcast: fx.Node) -> tuple[float, list[fx.Node]] | None:
    """(eps, nodes) for rsqrt(add(mean(pow(upcast, 2), [-1], keepdim), eps)), each step used
    only here; else None."""
    if not is_call(rsqrt, aten.rsqrt.default) or len(rsqrt.users) != 1:
        return None
    shifted = rsqrt.args[0]
    if not is_call(shifted, aten.add.Scalar, aten.add.Tensor) or len(shifted.users) != 1:
        return None
    mean, eps = shifted.args[0], scalar_value(shifted.args[1])
    if eps is None or not is_call(mean, aten.mean.dim) or len(mean.users) != 1:
        return None
    ndim = tensor_val(upcast).dim()
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not (is_last_dims(mean.args[1], ndim) and keepdim):
        return None
    square = mean.args[0]
    ok = (
        is_call(square, aten.pow.Tensor_Scalar)
        and square.args[0] is upcast
        and square.args[1] == 2
        and len(square.users) == 1
    )
    return (eps, [rsqrt, shifted, mean, square]) if ok else None


def _is_norm_weight(weight: fx.Node, normed: fx.Node) -> bool:
    weight_val, normed_val = tensor_val(weight), tensor_val(normed)
    if weight_val is None or normed_val is None:
        return False
    return (
        weight_val.dtype == normed_val.dtype
        and weight_val.dim() == 1
        and weight_val.shape[0] == normed_val.shape[-1]
    )


def _is_residual_add(h: fx.Node) -> bool:
    """h = add(x, delta) of two half-precision tensors of h's shape with rows under
    MAX_COLUMNS, delta's rows contiguous."""
    if not is_call(h, aten.add.Tensor) or h.kwargs.get("alpha", 1) != 1 or len(h.args) != 2:
        return False
    values = [tensor_val(a) for a in (h, *h.args)]
    if any(v is None for v in values):
        return False
    h_val, x_val, delta_val = values
    return (
        h_val.dtype in (torch.float16, torch.bfloat16)
        and all(v.shape == h_val.shape and v.dtype == h_val.dtype for v in (x_val, delta_val))
        and isinstance(h_val.shape[-1], int)
        and h_val.shape[-1] < MAX_COLUMNS
        and delta_val.stride(-1) == 1
    )


def _users_come_after(h: fx.Node, norm_steps: set[fx.Node], product: fx.Node) -> bool:
    """Whether every use of h outside its norm comes after the product."""
    later = set()
    cursor = product.next
    while cursor.op != "root":
        later.add(cursor)
        cursor = cursor.next
    return all(user in later for user in h.users if user not in norm_steps)


def _fuse(graph: fx.Graph, match: NormPrologueMatch) -> None:
    product, h = match.product, match.h
    x, delta = h.args
    h_val = tensor_val(h)
    rows = [-1, h_val.shape[-1]]
    with graph.inserting_before(product):
        x_rows = graph.call_function(aten.reshape.default, (x, rows))
        delta_rows = graph.call_function(aten.reshape.default, (delta, rows))
        args = (x_rows, delta_rows, match.weight, product.args[1], match.eps)
        target, run = _FUSED[product.target]
        fused = graph.call_function(target, args)
        out = graph.call_function(operator.getitem, (fused, 0))
        h_rows = graph.call_function(operator.getitem, (fused, 1))
        h_view = graph.call_function(aten.reshape.default, (h_rows, list(h_val.shape)))
    vals = [tensor_val(n) for n in (x, delta, match.weight, product.args[1])]
    with in_fake_mode(vals):
        x_rows.meta["val"] = vals[0].reshape(rows)
        delta_rows.meta["val"] = vals[1].reshape(rows)
        fused.meta["val"] = run(x_rows.meta["val"], delta_rows.meta["val"], *vals[2:], match.eps)
        out.meta["val"], h_rows.meta["val"] = fused.meta["val"]
        h_view.meta["val"] = h_rows.meta["val"].reshape(h_val.shape)
    copy_source_meta(product, fused)
    product.replace_all_uses_with(out)
    graph.erase_node(product)
    # The norm's steps die with the product; erase them (consumers first) before h's other
    # users move to the fused op's h, which comes after them.
    for step in match.chain:
        graph.erase_node(step)
    h.replace_all_uses_with(h_view)
    graph.erase_node(h)
