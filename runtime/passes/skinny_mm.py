"""Replacement pass: ATen mm with a few static rows times a Linear's weight -> `rt::skinny_mm`.

A decode step's projections reach the post-grad graph as

    mm(x [M, K], permute(w [N, K], [1, 0]))  (or any [K, N] operand with stride (1, K))

with M the step's row count: one per slot in a plain step, one per frontier node in a draft
step. ATen sends them to cuBLAS, whose tilings are made for large M;
runtime/kernels/skinny_mm.py says what the Triton op gains there. This pass swaps

    mm(x, w_t) -> rt::skinny_mm(x, permute(w_t, [1, 0]))

where the op takes the call and pays: float16 / bfloat16 operands on a device type the pass
was built for (CUDA by default; the op's CPU kernel is its float32 reference, slower than
ATen's mm there), a static M of at most `MAX_ROWS`, and the second operand's columns
contiguous in memory (a Linear's weight, transposed), so the kernel streams w row by row,
with fewer than 2**31 elements (the kernel's offsets are 32-bit).
"""

from __future__ import annotations

import torch
from torch import fx

from ..kernels import skinny_mm as skinny_kernel
from .fx_match import aten, copy_source_meta, in_fake_mode, is_call, tensor_val
from .manager import GraphPass


class SkinnyMMReplacement(GraphPass):
    """Replace every few-row mm by a Linear's weight with `rt::skinny_mm`; returns the number
    replaced.

    Args:
        device_types: the devices whose mms it replaces (tests add "cpu", where the op runs
            its reference).
    """

    name = "skinny_mm"
    version = 1

    def __init__(self, *, device_types: tuple[str, ...] = ("cuda",)) -> None:
        self.device_types = device_types

    def options(self) -> dict[str, object]:
        return {"device_types": self.device_types}

    def __call__(self, graph: fx.Graph) -> int:
        matches = [n for n in graph.nodes if self.matches(n)]
        for node in matches:
            _replace(graph, node)
        return len(matches)

    def matches(self, node: fx.Node) -> bool:
        """Whether `node` is an mm that `rt::skinny_mm` computes here."""
        if not is_call(node, aten.mm.default):
            return False
        x, w_t = (tensor_val(arg) for arg in node.args)
        if x is None or w_t is None or x.device.type not in self.device_types:
            return False
        if x.dtype not in skinny_kernel.DTYPES or w_t.dtype != x.dtype:
            return False
        num_rows = x.shape[0]
        if not isinstance(num_rows, int) or not 1 <= num_rows <= skinny_kernel.MAX_ROWS:
            return False
        return w_t.stride()[0] == 1 and skinny_kernel.within_offset_range(w_t)


def _replace(graph: fx.Graph, node: fx.Node) -> None:
    x, w_t = node.args
    with graph.inserting_before(node):
        w = graph.call_function(aten.permute.default, (w_t, [1, 0]))
        replacement = graph.call_function(torch.ops.rt.skinny_mm.default, (x, w))
    x_val, w_t_val = tensor_val(x), tensor_val(w_t)
    with in_fake_mode([x_val]):
        w.meta["val"] = w_t_val.permute(1, 0)
        replacement.meta["val"] = skinny_kernel.skinny_mm(x_val, w.meta["val"])
    copy_source_meta(node, replacement)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
