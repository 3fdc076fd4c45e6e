"""Recognise a scaled-dot-product attention call in a post-grad graph, whatever it lowered to.

`F.scaled_dot_product_attention` never reaches the post-grad graph as itself: while tracing,
the dispatcher picks a backend for the traced shapes, dtypes and device and records that
backend's op. So the same model line shows up as

- a fused op: `_scaled_dot_product_flash_attention_for_cpu` (CPU), `_efficient_attention` or
  `_cudnn_attention` (CUDA; the mask padded to a multiple of 16 and sliced back for the
  former), `_fused_attention_overrideable` (other backends), with the bool mask turned into an
  additive bias and output 0 selected by `getitem`; or
- the math fallback (CUDA picks it for a masked GQA call that no fused kernel takes, and on
  reduced precision it upcasts to float32): q and k each scaled by sqrt(scale), GQA as
  unsqueeze/expand/clone/reshape of K and V, two batched matmuls around an add of the bias and
  a (safe) softmax.

`match_sdpa(node)` returns the call `node` is the output of, in one normalised description,
or None. It checks every step against what the lowering computes (dims, constants, shapes,
dtypes), so a look-alike that computes something else is not an attention call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from .fx_match import (
    RESHAPES,
    aten,
    getitem_of,
    is_call,
    is_dim,
    is_fill,
    is_last_dims,
    kwargs_of,
    prims,
    same,
    same_shape,
    scalar_value,
    shape_of,
    strip_cast,
    strip_copies,
    tensor_val,
)

# Fused attention ops and the name of their additive-mask argument.
FUSED_OPS = {
    op: mask_arg
    for name, mask_arg in (
        ("_scaled_dot_product_flash_attention_for_cpu", "attn_mask"),
        ("_scaled_dot_product_efficient_attention", "attn_bias"),
        ("_scaled_dot_product_cudnn_attention", "attn_bias"),
        ("_scaled_dot_product_fused_attention_overrideable", "attn_bias"),
    )
    if (op := getattr(getattr(aten, name, None), "default", None)) is not None
}


@dataclass(frozen=True)
class SdpaCall:
    """One attention call: output = softmax(query @ key^T * scale + bias) @ value.

    output: the node holding the result [B, Hq, M, D] in query's dtype.
    query: [B, Hq, M, D]; key, value: [B, Hkv, L, D] with Hq % Hkv == 0 (query head h reads
        key head h // (Hq / Hkv)), before any repetition the lowering added.
    bias: the additive mask as given to the attention, before broadcasting or padding.
    scale: the softmax scale. form: which lowering it was ("math" or the fused op's name).
    """

    output: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    bias: fx.Node
    scale: float
    form: str


def match_sdpa(node: fx.Node) -> SdpaCall | None:
    """The attention call whose output `node` is, or None."""
    call = _match_fused(node) or _match_math(node)
    if call is None or not _consistent(call):
        return None
    return call


def _consistent(call: SdpaCall) -> bool:
    q, k, v, out = (tensor_val(n) for n in (call.query, call.key, call.value, call.output))
    if any(t is None or t.dim() != 4 for t in (q, k, v, out)):
        return False
    batch, num_q_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    return (
        same_shape(k.shape, v.shape)
        and same(k.shape[0], batch)
        and same(k.shape[3], head_dim)
        and same(num_q_heads % num_kv_heads, 0)
        and same_shape(out.shape, q.shape)
        and out.dtype == q.dtype == k.dtype == v.dtype
        and call.scale > 0
    )


def _match_fused(node: fx.Node) -> SdpaCall | None:
    op = getitem_of(node, 0)
    if not is_call(op, *FUSED_OPS):
        return None
    kwargs = kwargs_of(op)
    if kwargs is None or kwargs.get("dropout_p", 0.0) != 0.0 or kwargs.get("is_causal", False):
        return None
    bias = kwargs.get(FUSED_OPS[op.target])
    if bias is None:
        return None
    query = kwargs["query"]
    scale = kwargs.get("scale")
    if scale is None:
        head_dim = shape_of(query)[-1]
        if not isinstance(head_dim, int):
            return None
        scale = head_dim**-0.5
    key, value = _unrepeat_heads(kwargs["key"]), _unrepeat_heads(kwargs["value"])
    form = op.target._opname.removeprefix("_scaled_dot_product_")
    return SdpaCall(node, query, key, value, _unbroadcast_bias(bias), float(scale), form)


def _unbroadcast_bias(bias: fx.Node) -> fx.Node:
    """The bias before the lowering broadcast it to [B, H, M, L], padded and sliced it back
    (efficient attention wants a 16-aligned last dim) or made it contiguous: all value-free."""
    while True:
        if is_call(bias, aten.expand.default, aten.clone.default):
            bias = bias.args[0]
        elif _is_pad_then_slice(bias):
            bias = bias.args[0].args[0]
        else:
            return bias


def _is_pad_then_slice(node: fx.Node) -> bool:
    """slice(constant_pad_nd(x, [0, p]), -1, 0, L) with L = x's last size: x itself."""
    if not is_call(node, aten.slice.Tensor):
        return False
    padded = node.args[0]
    kwargs = kwargs_of(node)
    if not is_call(padded, aten.constant_pad_nd.default) or kwargs is None:
        return False
    inner = shape_of(padded.args[0])
    pad = list(padded.args[1])
    return (
        inner is not None
        and len(pad) == 2
        and pad[0] == 0
        and is_dim(kwargs["dim"], -1, len(inner))
        and kwargs["start"] in (0, None)
        and kwargs["step"] == 1
        and same_shape(shape_of(node), inner)
    )


def _unrepeat_heads(node: fx.Node) -> fx.Node:
    """x for K/V heads repeated for GQA, as reshape(clone(expand(unsqueeze(x, 2)))) to
    [B, Hkv * G, L, D] or repeat_interleave(x, G, dim=1); otherwise node itself."""
    if is_call(node, aten.repeat_interleave.self_int):
        kwargs = kwargs_of(node)
        if kwargs is not None and kwargs["dim"] is not None and is_dim(kwargs["dim"], 1, 4):
            return kwargs["self"]
        return node
    if not is_call(node, *RESHAPES):
        return node
    inner = node.args[0]
    if is_call(inner, aten.clone.default):
        inner = inner.args[0]
    if not is_call(inner, aten.expand.default) or not is_call(
        inner.args[0], aten.unsqueeze.default
    ):
        return node
    source = inner.args[0].args[0]
    src, out, grouped = shape_of(source), shape_of(node), shape_of(inner)
    if src is None or out is None or grouped is None or len(src) != 4 or len(grouped) != 5:
        return node
    batch, num_kv_heads, length, head_dim = src
    group = grouped[2]
    return (
        source
        if same_shape(grouped, (batch, num_kv_heads, group, length, head_dim))
        and same_shape(out, (batch, num_kv_heads * group, length, head_dim))
        else node
    )


def _match_math(node: fx.Node) -> SdpaCall | None:
    """node = [convert(] reshape(bmm(probs, value)) [)]: the math lowering's output."""
    out_dtype = getattr(tensor_val(node), "dtype", None)
    inner = node.args[0] if is_call(node, prims.convert_element_type.default) else node
    if (
        out_dtype is None
        or not is_call(inner, *RESHAPES)
        or not is_call(inner.args[0], aten.bmm.default)
    ):
        return None
    probs, value = (_unflatten_heads(x) for x in inner.args[0].args)
    if probs is None or value is None or not same_shape(shape_of(inner), _bmm_shape(probs, value)):
        return None
    logits = _softmax_input(probs)
    if not is_call(logits, aten.add.Tensor) or logits.kwargs.get("alpha", 1) != 1:
        return None
    scores, bias = logits.args
    qk = _match_scaled_qk(scores)
    if qk is None:
        bias, scores = logits.args
        qk = _match_scaled_qk(scores)
    if qk is None:
        return None
    query, key, scale = qk
    value = _source(value)
    bias = strip_cast(bias, torch.float32)
    if out_dtype != tensor_val(query).dtype:
        return None
    return SdpaCall(node, query, key, value, bias, scale, "math")


def _is_batched_matmul(node: fx.Node) -> bool:
    """node = reshape(bmm(a, b)), how matmul of 4-D operands returns."""
    return is_call(node, *RESHAPES) and is_call(node.args[0], aten.bmm.default)


def _bmm_shape(a: fx.Node, b: fx.Node) -> tuple | None:
    """Shape of a @ b for [B, H, R, K] @ [B, H, K, C] (same B and H, not just B * H)."""
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None or not same_shape(sa[:-2], sb[:-2]):
        return None
    return (*sa[:-1], sb[-1])


def _unflatten_heads(node: fx.Node) -> fx.Node | None:
    """x [B, H, R, C] for reshape(expand(x), [B * H, R, C]) (how matmul feeds bmm), else None."""
    if not is_call(node, *RESHAPES):
        return None
    source = strip_copies(node.args[0])
    src, out = shape_of(source), shape_of(node)
    if src is None or out is None or len(src) != 4:
        return None
    return source if same_shape(out, (src[0] * src[1], src[2], src[3])) else None


def _softmax_input(probs: fx.Node) -> fx.Node | None:
    """x for softmax(x, -1) written as a safe softmax (fully masked rows give 0), a plain
    decomposed softmax or a softmax op."""
    if is_call(probs, aten._softmax.default, aten._safe_softmax.default):
        kwargs = kwargs_of(probs)
        return kwargs["self"] if kwargs and is_last_dims(kwargs["dim"], 4) else None
    if is_call(probs, aten.where.self):
        cond, zeros, probs = probs.args
        logits = _decomposed_softmax_input(probs)
        return logits if is_fill(zeros, 0.0) and _is_all_masked(cond, logits) else None
    return _decomposed_softmax_input(probs)


def _decomposed_softmax_input(probs: fx.Node) -> fx.Node | None:
    """x for div(exp(sub(x, amax(x, -1))), sum(exp(...), -1)), or the online form Inductor
    writes on CUDA: (max, sum) = prepare_softmax_online(x, -1); div(exp(sub(x, max)), sum)."""
    if not is_call(probs, aten.div.Tensor):
        return None
    exp, total = probs.args
    if not is_call(exp, aten.exp.default) or not is_call(exp.args[0], aten.sub.Tensor):
        return None
    logits, row_max = exp.args[0].args
    online = _online_softmax_stats(row_max, total)
    if online is not None:
        return logits if online is logits else None
    return (
        logits
        if _is_last_dim_reduction(row_max, aten.amax.default, logits)
        and _is_last_dim_reduction(total, aten.sum.dim_IntList, exp)
        else None
    )


def _online_softmax_stats(row_max: fx.Node, total: fx.Node) -> fx.Node | None:
    """x when row_max, total = getitem(prepare_softmax_online(x, -1), 0 / 1)."""
    if not (is_call(row_max, operator.getitem) and is_call(total, operator.getitem)):
        return None
    stats = row_max.args[0]
    if total.args[0] is not stats or (row_max.args[1], total.args[1]) != (0, 1):
        return None
    if not is_call(stats, prims.prepare_softmax_online.default) or not is_dim(stats.args[1], -1, 4):
        return None
    return stats.args[0]


def _is_last_dim_reduction(node: fx.Node, target: object, source: fx.Node) -> bool:
    """target(source, [-1], keepdim=True)."""
    return (
        is_call(node, target)
        and node.args[0] is source
        and is_last_dims(node.args[1], 4)
        and (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim")) is True
    )


def _is_all_masked(cond: fx.Node, logits: fx.Node) -> bool:
    """cond = logical_not(any(logical_not(logits == -inf), -1, keepdim=True))."""
    if not is_call(cond, aten.logical_not.default) or not is_call(cond.args[0], aten.any.dim):
        return False
    any_node = cond.args[0]
    seen = any_node.args[0]
    if not is_call(seen, aten.logical_not.default) or not is_call(seen.args[0], aten.eq.Scalar):
        return False
    eq = seen.args[0]
    return (
        eq.args[0] is logits
        and scalar_value(eq.args[1]) == float("-inf")
        and is_dim(any_node.args[1], -1, 4)
        and any_node.args[2] is True
    )


def _match_scaled_qk(scores: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """(q, k, scale) for scores = reshape(bmm(q * c, k^T * c)) [B, H, M, L], scale = c^2."""
    if not _is_batched_matmul(scores):
        return None
    q_scaled, kt_scaled = (_unflatten_heads(x) for x in scores.args[0].args)
    if q_scaled is None or kt_scaled is None:
        return None
    if not same_shape(shape_of(scores), _bmm_shape(q_scaled, kt_scaled)):
        return None
    q_factor, kt_factor = _scaled_by(q_scaled), _scaled_by(kt_scaled)
    if q_factor is None or kt_factor is None or q_factor[1] != kt_factor[1]:
        return None
    key_t = kt_factor[0]
    if not is_call(key_t, aten.permute.default) or list(key_t.args[1]) != [0, 1, 3, 2]:
        return None
    return _source(q_factor[0]), _source(key_t.args[0]), q_factor[1] ** 2


def _source(node: fx.Node) -> fx.Node:
    """The tensor the math lowering read: before its float32 upcast and GQA head repeat."""
    return strip_cast(_unrepeat_heads(strip_cast(node, torch.float32)), torch.float32)


def _scaled_by(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(x, c) for x * c with a positive constant c."""
    if not is_call(node, aten.mul.Scalar, aten.mul.Tensor):
        return None
    factor = scalar_value(node.args[1])
    return (node.args[0], factor) if factor is not None and factor > 0 else None
