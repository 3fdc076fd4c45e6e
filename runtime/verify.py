"""Tree verification on the device: which draft nodes the target accepts, and the bonus token.

Sampling is exact by construction. At a node, drawing t from the target distribution p and
accepting the child whose token is t (or stopping with t as the bonus) accepts each child x
with probability p(x) and otherwise samples from p with every child removed: precisely the
multi-round rejection scheme for top-k (deterministic) drafts, with the rejected siblings'
mass removed, and so the emitted tokens are distributed as autoregressive samples of p.
Greedy is the same walk with one-hot p. The walk has a fixed D iterations and no host sync.
Stochastic trees (sampled drafts) are verified by rejection sampling instead: runtime/stochastic.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass
class Acceptance:
    """path: [B, D+1] int64 node indices from the root (entries past num_accepted repeat the
    last accepted node); num_accepted: [B] int64 accepted draft tokens (0..D);
    bonus: [B] int64 the target's token after the last accepted node (next round's root)."""

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor


def accept(tree: Tree, drawn: torch.Tensor, *, depth: int) -> Acceptance:
    """Walk the tree from the root, following the child whose token the target drew.

    Args:
        tree: the round's tree ([B, N] tokens/parent/depth).
        drawn: [B, N] int64 target draws per node (`sampling.draw_tokens`).
        depth: D, the tree's maximum depth.
    """
    batch = drawn.shape[0]
    current = torch.zeros(batch, dtype=torch.int64, device=drawn.device)
    alive = torch.ones(batch, dtype=torch.bool, device=drawn.device)
    num_accepted = torch.zeros_like(current)
    path = [current]
    # The root is its own parent; it must never match as a child of itself.
    not_root = torch.arange(drawn.shape[1], device=drawn.device) > 0
    for _ in range(depth):
        wanted = drawn.gather(1, current[:, None])
        is_child = (tree.parent == current[:, None]) & not_root
        match = is_child & (tree.tokens == wanted)
        found = alive & match.any(dim=-1)
        current = torch.where(found, match.int().argmax(dim=-1), current)
        num_accepted += found.long()
        alive = found
        path.append(current)
    bonus = drawn.gather(1, current[:, None])[:, 0]
    return Acceptance(torch.stack(path, dim=1), num_accepted, bonus)
