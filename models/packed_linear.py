"""Linear layers whose weights oneDNN has packed for this CPU, for eager decoding there.

ATen's CPU `linear` hands oneDNN a plain [N, K] weight on every call; a decode step's
products (one row, or a tree's few) then read the weights at about half the machine's memory
bandwidth (the embedded model's MLP on a 2-core AVX-512 EPYC in bf16: 19 GB/s against 40 for a
plain sum over the same bytes). Packed once into oneDNN's blocked layout, the same products
run at 30-41 GB/s at one row: 1.3-2.2x per product in bf16 at 1-13 rows, 1.05-1.2x at 128,
1.4-3.4x in float32 (faster at every size measured; BENCHMARKS.md). `pack_linears` swaps a
model's Linear modules for `PackedLinear`s that hold only the packed weight (the dense one
goes, so the model takes no more memory), except where other code reads the dense one
(`keep_weight`); `pack_target_and_head` does it for a target and its draft head.

The two ops are the ones Inductor's CPU freezing uses, not public API:
`torch.ops.mkldnn._reorder_linear_weight` and `torch.ops.mkldnn._linear_pointwise` (checked
against torch 2.13 on the CPU). `packs_linears` says where they are available and pay. Packed
modules run eagerly only: torch.compile does not trace oneDNN tensors, and nothing moves them
to another device.
"""

from __future__ import annotations

import torch
from torch import nn

from .eagle import DraftHead, SharedModules
from .fused_linear import FusedLinear
from .llama import Llama

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Exact types: subclasses of nn.Linear with other forwards (tensor-parallel layers) stay.
_PACKABLE = (nn.Linear, FusedLinear)


def packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether eager forwards on `device` in `dtype` take packed weights: a CPU with oneDNN
    (and its linear ops in this torch), float32 or bfloat16."""
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """y = x W^T (+ b) from W packed by oneDNN; a FusedLinear's parts as FusedLinear gives
    them (`joint`, and `forward` splitting them).

    Args:
        linear: the Linear (or FusedLinear) to pack, float32 or bfloat16 on the CPU.
        keep_weight: also keep its dense weight as `weight` (for code that reads it).
    """

    def __init__(self, linear: nn.Linear, *, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.parts = dict(linear.parts) if isinstance(linear, FusedLinear) else None
        with torch.no_grad():
            # The second argument is the batch size oneDNN may tune the layout for (a hint).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias
        if keep_weight:
            self.weight = linear.weight

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] in the weight's dtype -> [..., out_features]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """x: [..., in_features] -> [..., out_features], or a FusedLinear's parts."""
        out = self.joint(x)
        return out if self.parts is None else out.split(list(self.parts.values()), dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module, *, keep_weight: tuple[str, ...] = ()) -> int:
    """Replace every Linear of `model` (FusedLinears included) by a PackedLinear, in place;
    the modules named in `keep_weight` (e.g. "lm_head") keep their dense weight too. Returns
    the number replaced. Modules that hold one of these Linears outside `model`'s tree must
    be pointed at the replacements by the caller."""
    # Names only: each dense weight is freed as soon as its module is replaced, so the next
    # packed weight can take its memory (the model never holds both layouts of every layer).
    names = [name for name, module in model.named_modules() if type(module) in _PACKABLE]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        packed = PackedLinear(getattr(parent, child), keep_weight=name in keep_weight)
        setattr(parent, child, packed)
    return len(names)


def pack_target_and_head(target: Llama, head: DraftHead | None) -> int:
    """`pack_linears` over a target and its draft head, in place: the target's LM head keeps
    its dense weight (the runtime reads it for the model's device and dtype; a tied
    embedding shares it anyway), and the head borrows the packed target modules. Returns the
    number of Linears packed."""
    num_packed = pack_linears(target, keep_weight=("lm_head",))
    if head is not None:
        num_packed += pack_linears(head)
        head.shared = SharedModules(embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    return num_packed
