"""Replacement pass: ATen topk with a small k over the last dimension -> `rt::topk`.

Drafting a tree takes the top k (k <= 16 or so) of every frontier node's distribution over the
draft vocabulary, level after level. Inductor has no lowering of its own for topk, so each
call falls back to ATen's radix select, the costliest kernel of a small model's draft phase
(runtime/kernels/topk.py says how much). EAGLE-2 levels call `rt::log_softmax_topk` directly
(runtime/tree.py: selection and normalisation in one launch); other code, static trees
included, keeps calling `torch.topk`, which is its eager reference, and in compiled graphs
this pass swaps

    topk(x, k, dim=-1, largest=True, sorted=True or False) -> (values, indices)

for `rt::topk(x, k)` where the op takes the call: a float16 / bfloat16 / float32 input whose
last dimension and k are static, with k <= `MAX_K`. rt::topk returns its entries sorted, which
either `sorted` allows, and orders equal values by index, one of the orders ATen may return.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..kernels import topk as topk_kernel
from .fx_match import aten, copy_source_meta, in_fake_mode, is_call, is_dim, kwargs_of, tensor_val
from .manager import GraphPass

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class SmallTopkReplacement(GraphPass):
    """Replace every small-k last-dimension topk by `rt::topk`; returns the number replaced."""

    name = "small_topk"
    version = 1

    def __call__(self, graph: fx.Graph) -> int:
        matches = [(n, m) for n in graph.nodes if (m := match_small_topk(n)) is not None]
        for node, (x, k) in matches:
            _replace(graph, node, x, k)
        return len(matches)


def match_small_topk(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, k), if `node` is a topk call that `rt::topk` computes; else None."""
    if not is_call(node, aten.topk.default):
        return None
    kwargs = kwargs_of(node)
    x = tensor_val(kwargs["input"]) if kwargs is not None else None
    if x is None or x.dtype not in _DTYPES or x.dim() == 0:
        return None
    k, num_cols = kwargs["k"], x.shape[-1]
    if not (isinstance(k, int) and isinstance(num_cols, int)):
        return None
    if not is_dim(kwargs.get("dim", -1), -1, x.dim()) or not kwargs.get("largest", True):
        return None
    return (kwargs["input"], k) if 1 <= k <= min(topk_kernel.MAX_K, num_cols) else None


def _replace(graph: fx.Graph, node: fx.Node, x: fx.Node, k: int) -> None:
    with graph.inserting_before(node):
        replacement = graph.call_function(torch.ops.rt.topk.default, (x, k))
    value = tensor_val(x)
    with in_fake_mode([value]):
        replacement.meta["val"] = topk_kernel.topk(value, k)
    copy_source_meta(node, replacement)
    node.replace_all_uses_with(replacement)
    for user in replacement.users:
        assert is_call(user, operator.getitem), f"topk output used by {user.format_node()}"
        user.meta["val"] = replacement.meta["val"][user.args[1]]
    graph.erase_node(node)
