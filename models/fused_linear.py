"""Projections of one input fused into one GEMM, with the checkpoint layout kept separate.

Attention's q/k/v and the MLP's gate/up read the same activation: one Linear over their
concatenated rows launches one GEMM instead of three (or two), which is most of what a decode
step of a small model costs (it is bound by kernel launches). Checkpoints keep the separate
projections: the module holding a FusedLinear calls `store_parts_separately(self)`, after
which `state_dict()` writes each part under its own name beside the fused module
(`self_attn.q_proj.weight`, ...) and `load_state_dict()` accepts those names, so HF and EAGLE
key layouts are unchanged; `part_slices` tells a streaming loader where each part's rows go.
The hooks sit on the parent because `load_state_dict` hands a child only the keys under the
child's own prefix, where its siblings' names are not.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

_SUFFIXES = ("weight", "bias")


class FusedLinear(nn.Linear):
    """y = x W^T (+ b) for several projections at once, returned as a tuple of parts.

    Args:
        in_features: the input size.
        parts: each part's checkpoint name (a sibling of this module) -> its output size,
            in the order their rows are stacked.
        bias: whether every part has a bias.
    """

    def __init__(self, in_features: int, parts: Mapping[str, int], *, bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [..., in_features] -> one [..., size] tensor per part (views of one output)."""
        return self.joint(x).split(list(self.parts.values()), dim=-1)

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features], the parts side by side."""
        return super().forward(x)

    def part_names(self, prefix: str) -> dict[str, dict[str, slice]]:
        """{"weight"/"bias": {checkpoint name: rows}} for this module at `prefix` (its
        state-dict prefix, ending in '.', or '' at the top level)."""
        parent = prefix[:-1].rpartition(".")[0]
        parent = f"{parent}." if parent else ""
        names: dict[str, dict[str, slice]] = {}
        for suffix in _SUFFIXES:
            if getattr(self, suffix) is None:
                continue
            start, rows = 0, {}
            for part, size in self.parts.items():
                rows[f"{parent}{part}.{suffix}"] = slice(start, start + size)
                start += size
            names[suffix] = rows
        return names


def part_slices(model: nn.Module) -> dict[str, tuple[str, slice]]:
    """Every fused part of `model`: checkpoint name -> (fused parameter name, its rows)."""
    slices = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedLinear):
            prefix = f"{name}." if name else ""
            for suffix, rows in module.part_names(prefix).items():
                slices |= {part: (prefix + suffix, span) for part, span in rows.items()}
    return slices


def store_parts_separately(module: nn.Module) -> None:
    """Store each FusedLinear child of `module` as its parts in state dicts (see above)."""
    module.register_state_dict_post_hook(_split_parts)
    module.register_load_state_dict_pre_hook(_merge_parts)


def _fused_children(module: nn.Module, prefix: str) -> list[tuple[FusedLinear, str]]:
    return [
        (child, f"{prefix}{name}.")
        for name, child in module.named_children()
        if isinstance(child, FusedLinear)
    ]


def _split_parts(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for fused, fused_prefix in _fused_children(module, prefix):
        for suffix, rows in fused.part_names(fused_prefix).items():
            tensor = state_dict.pop(fused_prefix + suffix)
            for part, span in rows.items():
                state_dict[part] = tensor[span]


def _merge_parts(
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata,
    strict,
    missing_keys,
    unexpected_keys,
    error_msgs,
) -> None:
    """Stack the parts into the fused tensor when all of them are given (otherwise the fused
    name is reported missing and the parts unexpected, as for any other layout)."""
    for fused, fused_prefix in _fused_children(module, prefix):
        for suffix, rows in fused.part_names(fused_prefix).items():
            if all(part in state_dict for part in rows):
                parts = [state_dict.pop(part) for part in rows]
                state_dict[fused_prefix + suffix] = torch.cat(parts)
