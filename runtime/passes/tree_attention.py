"""Fusion pass: the reference tree attention of models/attention.py -> `rt::tree_attention`.

`models.attention.tree_attention` builds a bool mask [B, M, S + N] (prefix positions
< cache_len, then the ancestor bitmask unpacked bit by bit), concatenates cache and tree K/V
and calls SDPA. After tracing, that is (in the post-grad ATen graph)

    iota(S) < cache_len[:, None]  --unsqueeze/expand-->  prefix [B, M, S]
    ((anc[..., iota(N) // 64] >> iota(N) % 64) & 1).bool()  tree [B, M, N]
    cat([prefix, tree], -1)  --unsqueeze(1), where(mask, 0, -inf)-->  additive bias
                               (cuDNN: where(~mask, -65504, 0))
    cat([k_cache, k_tree], 2), cat([v_cache, v_tree], 2)
    SDPA(q, k, v, bias, scale) in whichever lowering the trace picked (see sdpa.py)

The pass anchors on each attention output (`sdpa.match_sdpa`), checks that its bias is
exactly that mask and its K/V exactly those concatenations, and replaces the output by one
`rt::tree_attention(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, scale=...)` call.
Dead-code elimination then drops the mask and the concatenations: no [M, S + N] mask or
concatenated K/V is built. The op writes its output in [B, M, Hq, D] memory order, the order
the output projection reads; the copy into that order which the trace made of SDPA's
[B, Hq, M, D] output (`transpose(1, 2).reshape(...)` with M > 1) would now copy a buffer onto
its own layout, so the pass routes the copy's users to the transposed op output instead.
On CUDA a match is fused only where the kernel takes the arguments (`check_inputs`: e.g. a
power-of-two head dim); elsewhere the graph is left as is.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..kernels import tree_attention as tree_attention_kernel
from ..kernels.tree_attention_config import check_inputs
from .fx_match import (
    aten,
    copy_source_meta,
    getitem_of,
    in_fake_mode,
    is_call,
    is_dim,
    is_fill,
    known_true,
    kwargs_of,
    prims,
    same,
    shape_of,
    tensor_val,
)
from .manager import GraphPass
from .sdpa import FUSED_OPS, SdpaCall, match_sdpa

logger = logging.getLogger(__name__)

BITS_PER_WORD = 64
_FLOOR_DIVS = (aten.div.Tensor_mode, aten.floor_divide.default)
_WHERES = (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
# What SDPA writes for a False entry of a bool mask: -inf, or on the cuDNN path (torch 2.10,
# 2.11: convert_boolean_attn_mask_cudnn) the finite stand-in -65504 (fp16's lowest), which
# masks the same way unless a row's scores span ~65504, so the bool-mask source is exact.
# The constant is stored in the bias dtype: in bf16, -65504 rounds to -65536 (seen on an H100).
_MASKED_VALUES = (float("-inf"), -65504.0)
_TRANSPOSES = (aten.transpose.int, aten.permute.default)


@dataclass(frozen=True)
class TreeMask:
    """The pieces the mask was built from: anc [B, M, W] int64, cache_len [B] int64, and
    the number of cache positions S and tree keys N it covers."""

    anc: fx.Node
    cache_len: fx.Node
    num_cache: Any
    num_tree: Any


@dataclass(frozen=True)
class TreeAttention:
    """One recognised tree attention: the arguments of the equivalent `rt::tree_attention`."""

    output: fx.Node
    args: tuple[fx.Node, ...]
    scale: float
    form: str


class TreeAttentionFusion(GraphPass):
    """Replace every reference tree attention by `rt::tree_attention`; returns the number
    fused. `num_fused_by_form` counts them by the SDPA lowering they replaced,
    `num_fixed_config` those in graphs with dynamic shapes (given one launch config),
    `num_output_copies_dropped` the copies of an op output onto its own layout it removed, and
    `num_unfused_by_reason` the attention calls left as they were, by why (`unfused_reason`;
    a fused attention op whose arguments `match_sdpa` does not read counts there too): every
    attention the models make is a tree attention, so any entry there is a call the Triton
    op does not get."""

    name = "tree_attention"
    version = 2

    def __init__(self) -> None:
        self.num_fused_by_form: Counter[str] = Counter()
        self.num_fixed_config = 0
        self.num_unfused_by_reason: Counter[str] = Counter()
        self.num_output_copies_dropped = 0

    def __call__(self, graph: fx.Graph) -> int:
        calls = [call for node in graph.nodes if (call := match_sdpa(node)) is not None]
        matches = [match_tree_attention(call.output) for call in calls]
        fused = []
        for call, match in zip(calls, matches, strict=True):
            fixed = match is not None and _has_symbolic_shapes(match)
            reason = unfused_reason(call) if match is None else _fuse(graph, match, fixed)
            if reason is None:
                fused.append((match, fixed))
            else:
                self.num_unfused_by_reason[reason] += 1
                logger.warning("attention %s (%s) left unfused: %s", call.output, call.form, reason)
        for op in _unrecognised_fused_attention(graph, calls):
            form = op.target._opname.removeprefix("_scaled_dot_product_")
            self.num_unfused_by_reason[f"its {form} call is not one match_sdpa reads"] += 1
            logger.warning("attention %s (%s) left unfused: not recognised", op, form)
        self.num_fused_by_form.update(match.form for match, _ in fused)
        self.num_fixed_config += sum(f for _, f in fused)
        ops = [n for n in graph.nodes if is_call(n, torch.ops.rt.tree_attention.default)]
        self.num_output_copies_dropped += sum(_drop_output_copy(graph, op) for op in ops)
        return len(fused)


def _unrecognised_fused_attention(graph: fx.Graph, calls: list[SdpaCall]) -> list[fx.Node]:
    """The fused attention ops of `graph` that no recognised call reads its output from:
    arguments `match_sdpa` does not take (a causal flag, a missing mask, dropout) or a
    lowering it does not know, which would otherwise be neither fused nor counted."""
    recognised = {getitem_of(call.output, 0) for call in calls}
    return [node for node in graph.nodes if is_call(node, *FUSED_OPS) and node not in recognised]


def match_tree_attention(node: fx.Node) -> TreeAttention | None:
    """The tree attention whose output `node` is, or None."""
    call = match_sdpa(node)
    if call is None:
        return None
    mask = match_tree_mask(call.bias)
    if mask is None:
        return None
    k_parts = _match_cache_then_tree(call.key, mask)
    v_parts = _match_cache_then_tree(call.value, mask)
    if k_parts is None or v_parts is None or not _fits(call, mask):
        return None
    args = (call.query, k_parts[0], v_parts[0], mask.cache_len, k_parts[1], v_parts[1], mask.anc)
    return TreeAttention(call.output, args, call.scale, call.form)


def unfused_reason(call: SdpaCall) -> str:
    """Why an attention call is not a tree attention: the first part that differs."""
    mask = match_tree_mask(call.bias)
    if mask is None:
        return f"its bias ({call.bias.target}) is not the reference tree mask"
    if _match_cache_then_tree(call.key, mask) is None:
        return "its keys are not cat([cache, tree]) of the mask's lengths"
    if _match_cache_then_tree(call.value, mask) is None:
        return "its values are not cat([cache, tree]) of the mask's lengths"
    return "its query's batch or rows differ from the mask's"


def _fits(call: SdpaCall, mask: TreeMask) -> bool:
    """The query's batch and row count are the mask's."""
    q_shape, anc_shape = shape_of(call.query), shape_of(mask.anc)
    return same(q_shape[0], anc_shape[0]) and same(q_shape[2], anc_shape[1])


def match_tree_mask(bias: fx.Node) -> TreeMask | None:
    """bias = where(unsqueeze(cat([prefix, tree], -1), 1), 0, -inf): the reference's mask."""
    cond = _visible_where_zero(bias)
    if not is_call(cond, aten.unsqueeze.default) or not is_dim(cond.args[1], 1, 4):
        return None
    mask = cond.args[0]
    if not is_call(mask, aten.cat.default) or len(mask.args[0]) != 2:
        return None
    if not is_dim(mask.args[1] if len(mask.args) > 1 else 0, -1, 3):
        return None
    prefix = _match_prefix_mask(mask.args[0][0])
    tree = _match_ancestor_bits(mask.args[0][1])
    if prefix is None or tree is None:
        return None
    return TreeMask(tree[0], prefix[0], prefix[1], tree[1])


def _visible_where_zero(bias: fx.Node) -> fx.Node | None:
    """m for where(m, 0, masked) or where(~m, masked, 0): a bool mask as an additive bias."""
    if not is_call(bias, *_WHERES):
        return None
    cond, if_true, if_false = bias.args
    dtype = getattr(tensor_val(bias), "dtype", torch.float32)
    if is_fill(if_true, 0.0) and _is_masked_value(if_false, dtype):
        return cond
    inverted = is_call(cond, aten.logical_not.default) or (
        is_call(cond, aten.bitwise_not.default) and tensor_val(cond).dtype == torch.bool
    )
    if inverted and _is_masked_value(if_true, dtype) and is_fill(if_false, 0.0):
        return cond.args[0]
    return None


def _is_masked_value(arg: Any, dtype: torch.dtype) -> bool:
    """A fill equal to -inf or the cuDNN stand-in, as represented in `dtype`."""
    candidates = {float(torch.tensor(value, dtype=dtype)) for value in _MASKED_VALUES}
    return any(is_fill(arg, value) for value in candidates | set(_MASKED_VALUES))


def _match_prefix_mask(node: fx.Node) -> tuple[fx.Node, Any] | None:
    """(cache_len, S) for [expand(]unsqueeze(iota(S)[None, :] < cache_len[:, None], 1)[)]."""
    if is_call(node, aten.expand.default):
        node = node.args[0]
    if not is_call(node, aten.unsqueeze.default) or not is_dim(node.args[1], 1, 3):
        return None
    less = node.args[0]
    if not is_call(less, aten.lt.Tensor):
        return None
    positions, lengths = less.args
    if not (_is_unsqueeze(positions, 0) and _is_unsqueeze(lengths, 1)):
        return None
    num_cache = _iota_length(positions.args[0])
    cache_len = lengths.args[0]
    if num_cache is None or not _is_int64(cache_len, ndim=1):
        return None
    return cache_len, num_cache


def _match_ancestor_bits(node: fx.Node) -> tuple[fx.Node, Any] | None:
    """(anc, N) for bool((anc[..., key // 64] >> key % 64) & 1), key = iota(N)."""
    if not _is_nonzero_test(node):
        return None
    bit = node.args[0]
    if not is_call(bit, aten.bitwise_and.Scalar) or bit.args[1] != 1:
        return None
    shifted = bit.args[0]
    if not is_call(shifted, aten.__rshift__.Tensor):
        return None
    words, offset = shifted.args
    if not is_call(offset, aten.remainder.Scalar) or offset.args[1] != BITS_PER_WORD:
        return None
    key = offset.args[0]
    num_tree = _iota_length(key)
    if num_tree is None or not is_call(words, aten.index.Tensor):
        return None
    anc, indices = words.args
    if not _is_int64(anc, ndim=3) or len(indices) != 3 or indices[:2] != [None, None]:
        return None
    if not _is_word_of(indices[2], key) or not _covers(anc, num_tree):
        return None
    return anc, num_tree


def _is_nonzero_test(node: fx.Node) -> bool:
    """node = x.bool() (or x != 0)."""
    if is_call(node, prims.convert_element_type.default):
        return node.args[1] == torch.bool
    return is_call(node, aten.ne.Scalar) and node.args[1] == 0


def _is_word_of(node: Any, key: fx.Node) -> bool:
    """node = key // 64 (floor division)."""
    if not is_call(node, *_FLOOR_DIVS) or node.args[0] is not key or node.args[1] != BITS_PER_WORD:
        return False
    kwargs = kwargs_of(node)
    return kwargs is not None and kwargs.get("rounding_mode", "floor") == "floor"


def _covers(anc: fx.Node, num_tree: Any) -> bool:
    # With symbolic shapes 64 * W >= N may be unprovable; the reference raises on an
    # out-of-range word index, so wherever it is defined the words cover the keys.
    return not known_true(shape_of(anc)[2] * BITS_PER_WORD < num_tree)


def _is_unsqueeze(node: Any, dim: int) -> bool:
    if not is_call(node, aten.unsqueeze.default):
        return False
    source = shape_of(node.args[0])
    return source is not None and len(source) == 1 and is_dim(node.args[1], dim, 2)


def _iota_length(node: Any) -> Any | None:
    """n for iota(n, start=0, step=1) of int64 (torch.arange(n) after decomposition)."""
    if not is_call(node, prims.iota.default):
        return None
    kwargs = kwargs_of(node)
    if kwargs is None or kwargs["start"] != 0 or kwargs["step"] != 1:
        return None
    return shape_of(node)[0] if kwargs["dtype"] == torch.int64 else None


def _is_int64(node: Any, *, ndim: int) -> bool:
    value = tensor_val(node)
    return value is not None and value.dtype == torch.int64 and value.dim() == ndim


def _match_cache_then_tree(node: fx.Node, mask: TreeMask) -> tuple[fx.Node, fx.Node] | None:
    """(cache, tree) for cat([cache, tree], 2) with S cache and N tree positions."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2 or len(node.args) < 2:
        return None
    if not is_dim(node.args[1], 2, 4):
        return None
    cache, tree = node.args[0]
    cache_shape, tree_shape = shape_of(cache), shape_of(tree)
    if cache_shape is None or tree_shape is None or len(cache_shape) != 4:
        return None
    if not (same(cache_shape[2], mask.num_cache) and same(tree_shape[2], mask.num_tree)):
        return None
    return cache, tree


def _fuse(graph: fx.Graph, match: TreeAttention, fixed_config: bool) -> str | None:
    """Swap the match's output for one `rt::tree_attention` call if the op takes the inputs;
    else leave it and return why not."""
    values = [tensor_val(arg) for arg in match.args]
    refusal = _op_refusal(values, match.scale)
    if refusal is not None:
        return refusal
    kwargs = {"scale": match.scale, "fixed_config": fixed_config}
    with graph.inserting_before(match.output):
        fused = graph.call_function(torch.ops.rt.tree_attention.default, match.args, kwargs)
    with in_fake_mode(values):
        fused.meta["val"] = tree_attention_kernel.tree_attention(*values, **kwargs)
    copy_source_meta(match.output, fused)
    match.output.replace_all_uses_with(fused)
    _erase_fused_attention(graph, match.output)
    return None


def _drop_output_copy(graph: fx.Graph, fused: fx.Node) -> bool:
    """Route the users of `copy(transpose(fused))` to the transpose where the copy would
    keep the layout it copies (the op's output order); returns whether it did. Only where
    the transpose is the op's sole user and the copy the transpose's: nothing else sees the
    buffer the copy's users now share."""
    transpose = _sole_user(fused)
    if transpose is None or not is_call(transpose, *_TRANSPOSES):
        return False
    copy = _sole_user(transpose)
    copied = tensor_val(copy)
    if copied is None or not is_call(copy, aten.clone.default):
        return False
    output = tensor_val(fused)
    with in_fake_mode([output]):
        transposed = transpose.target(output, *transpose.args[1:], **transpose.kwargs)
    layouts = zip(
        (*transposed.shape, *transposed.stride()), (*copied.shape, *copied.stride()), strict=True
    )
    if transposed.dim() != copied.dim() or not all(same(a, b) for a, b in layouts):
        return False
    transpose.meta["val"] = transposed
    copy.replace_all_uses_with(transpose)
    graph.erase_node(copy)
    return True


def _sole_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _has_symbolic_shapes(match: TreeAttention) -> bool:
    """Whether the graph was traced with dynamic shapes here (a prefill): the op then runs
    with one launch config, so that its kernel, compiled once, serves every length."""
    values = [tensor_val(arg) for arg in match.args]
    return not all(is_concrete_int(size) for value in values for size in value.shape)


def _erase_fused_attention(graph: fx.Graph, output: fx.Node) -> None:
    """Erase a now-unused fused attention op: with dropout 0 it draws no random numbers, but
    it is tagged nondeterministic_seeded, so dead-code elimination would keep it."""
    op = getitem_of(output, 0)
    if op is None or any(user.users for user in op.users):
        return
    for user in list(op.users):
        graph.erase_node(user)
    graph.erase_node(op)


def _op_refusal(values: list[torch.Tensor], scale: float) -> str | None:
    """Why `rt::tree_attention` does not run these arguments (CUDA: what the kernel supports),
    or None when it does."""
    if values[0].device.type != "cuda":
        return None
    try:
        check_inputs(*values, scale=scale)
    except ValueError as error:
        return f"the CUDA kernel does not take it: {error}"
    return None
