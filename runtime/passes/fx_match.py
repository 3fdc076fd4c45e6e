"""Small, exact predicates over post-grad FX nodes, shared by the fusion passes, and the two
steps every rewrite takes (`in_fake_mode`, `copy_source_meta`).

A post-grad graph is functional ATen: every node's `meta["val"]` is a fake tensor (or a
tuple of them), shapes may be symbolic, and arguments come positionally or by keyword
depending on how the decomposition that produced them was written. These helpers hide
those differences: `kwargs_of` normalises a call to its schema's keyword form (defaults
filled in), `same` compares
sizes without adding guards, `scalar_value` reads a constant that constant folding may have
turned into a `full([])` node. Every predicate answers "is this exactly X"; none guesses.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten
prims = torch.ops.prims

RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def is_call(node: Any, *targets: Any) -> bool:
    """Whether `node` is a call_function node of one of `targets`."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def val(node: fx.Node) -> Any:
    """The node's fake value (None when the graph carries no metadata for it)."""
    return node.meta.get("val")


def tensor_val(node: Any) -> torch.Tensor | None:
    """The node's fake tensor, or None if it is not a tensor-valued node."""
    value = val(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def shape_of(node: Any) -> tuple[Any, ...] | None:
    value = tensor_val(node)
    return None if value is None else tuple(value.shape)


def known_true(condition: Any) -> bool:
    """A (possibly symbolic) condition that holds for every value of its symbols; never adds
    a guard, so it is safe in a pass that runs after guards are final."""
    return statically_known_true(condition)


def same(a: Any, b: Any) -> bool:
    """Sizes (ints or SymInts) equal for every value of the symbols."""
    return known_true(a == b)


def same_shape(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(map(same, a, b))


def kwargs_of(node: fx.Node) -> dict[str, Any] | None:
    """The call's arguments by schema name, defaults omitted (None if it cannot normalise)."""
    pair = normalize_function(
        node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
    )
    return None if pair is None else dict(pair.kwargs)


def getitem_of(node: Any, index: int) -> fx.Node | None:
    """The multi-output node `node` selects element `index` of, or None."""
    if is_call(node, operator.getitem) and node.args[1] == index:
        return node.args[0]
    return None


def scalar_value(arg: Any) -> float | None:
    """A constant scalar: a Python number, or a `full([], value)` node constant folding made."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if is_call(arg, aten.full.default) and list(arg.args[0]) == []:
        return scalar_value(arg.args[1])
    if is_call(arg, aten.scalar_tensor.default):
        return scalar_value(arg.args[0])
    return None


def is_fill(arg: Any, value: float) -> bool:
    """A constant tensor (any shape) or scalar whose every element is `value`."""
    fill = scalar_value(arg.args[1] if is_call(arg, aten.full.default) else arg)
    return fill is not None and (fill == value or (math.isnan(fill) and math.isnan(value)))


def is_dim(dim: Any, want: int, ndim: int) -> bool:
    """`dim` (possibly negative) names dimension `want` (possibly negative) of an ndim tensor."""
    return isinstance(dim, int) and -ndim <= dim < ndim and dim % ndim == want % ndim


def is_last_dims(dims: Any, ndim: int) -> bool:
    """A reduction over exactly the last dimension (`-1`, `[-1]` or `[ndim - 1]`)."""
    if isinstance(dims, (list, tuple)):
        return len(dims) == 1 and is_dim(dims[0], -1, ndim)
    return is_dim(dims, -1, ndim)


def strip_copies(node: Any) -> Any:
    """x for value-preserving wrappers of x of the same shape: `expand(x, x.shape)` and
    `clone(x)` (matmul decompositions emit both to get a contiguous batch)."""
    while is_call(node, aten.expand.default, aten.clone.default) and same_shape(
        shape_of(node.args[0]), shape_of(node)
    ):
        node = node.args[0]
    return node


def strip_cast(node: Any, dtype: torch.dtype) -> Any:
    """x for `convert_element_type(x, dtype)` from a narrower float (an upcast), else node."""
    if is_call(node, prims.convert_element_type.default) and node.args[1] == dtype:
        source = tensor_val(node.args[0])
        if source is not None and source.dtype in (torch.float16, torch.bfloat16):
            return node.args[0]
    return node


def in_fake_mode(values: Sequence[Any]) -> contextlib.AbstractContextManager:
    """The fake mode of `values` (the graph's fake tensors), to compute a new node's
    `meta["val"]` in; a no-op context where they carry none."""
    return detect_fake_mode(values) or contextlib.nullcontext()


def copy_source_meta(source: fx.Node, replacement: fx.Node) -> None:
    """Give `replacement` the stack trace and module stack of the node it replaces (what
    Inductor's kernel names and provenance come from)."""
    for key in ("stack_trace", "nn_module_stack"):
        if key in source.meta:
            replacement.meta[key] = source.meta[key]
