"""`rt::rejection_walk`: recursive rejection sampling down a stochastic draft tree, in Triton.

A stochastic tree (runtime/stochastic.py) is verified by walking it from the root: at each
node the kept children are tried in draw order, child x accepted with probability
min(1, r(x) / q(x)); a rejection replaces the residual r by normalise(max(r - q, 0)) and takes
x out of the draft distribution q. In PyTorch that is D levels x K tries of masked [B, V_draft]
ops whether or not a row is still trying: several hundred small kernels per round, about
0.4 ms on an H100 for (6, 8, 40), a quarter of the round.

Here one program walks one row and does only the work the row needs: a level's start copies
the node's target mass on the draft vocabulary and its draft distribution into scratch, an
acceptance costs two scalar loads, and only a rejection streams the vocabulary once (new
residual, its sum, and q's sum without x). r and q stay unnormalised in scratch, each with
its scalar divisor, so no pass is spent renormalising. Rows stop early; a level no longer
alive costs nothing.

Numerics follow `rejection_walk_ref` (the module's plain-PyTorch walk, which CPU tensors and
torch.compile's fake tensors take) to float32 rounding: the sums run in another order, so a
uniform within rounding of an acceptance threshold can decide differently.

The kernel lives in rejection_triton.py, imported at the first launch, so this module loads
without Triton, where the op runs the reference on every device (see _triton.py).
"""

from __future__ import annotations

import torch

from ._triton import rt_op, uses_triton


def check_rejection_walk_inputs(
    probs, parent, node_row, node_draft_id, draft_probs, draft_to_target, uniforms
) -> None:
    """Raise ValueError unless the arguments fit `rejection_walk`'s shapes and dtypes."""
    if probs.dim() != 3 or draft_probs.dim() != 3 or uniforms.dim() != 3:
        raise ValueError(
            "rt::rejection_walk takes probs [B, N, V], draft_probs [B, R, V_draft] and "
            f"uniforms [B, D, K]; got {tuple(probs.shape)}, {tuple(draft_probs.shape)}, "
            f"{tuple(uniforms.shape)}"
        )
    batch, num_nodes, _ = probs.shape
    for name, t in (("parent", parent), ("node_row", node_row), ("node_draft_id", node_draft_id)):
        if t.shape != (batch, num_nodes) or t.dtype != torch.int64:
            raise ValueError(f"rt::rejection_walk: {name} must be [{batch}, {num_nodes}] int64")
    if draft_to_target.shape != draft_probs.shape[-1:] or draft_to_target.dtype != torch.int64:
        raise ValueError("rt::rejection_walk: draft_to_target must be [V_draft] int64")
    if draft_probs.shape[0] != batch or uniforms.shape[0] != batch:
        raise ValueError("rt::rejection_walk: probs, draft_probs and uniforms differ in batch")
    for name, t in (("probs", probs), ("draft_probs", draft_probs), ("uniforms", uniforms)):
        if t.dtype != torch.float32:
            raise ValueError(f"rt::rejection_walk: {name} must be float32, got {t.dtype}")


@rt_op("rt::rejection_walk")
def rejection_walk(
    probs: torch.Tensor,
    parent: torch.Tensor,
    node_row: torch.Tensor,
    node_draft_id: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_to_target: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling without replacement down each row's tree
    (`rt::rejection_walk`; runtime/stochastic.py states the rule and why it is exact).

    At each level the current node's children (nodes whose parent it is, in node order, the
    draw order) are tried in turn: child x, the draft id of the i-th, is accepted when
    u * q(x) < r(x) with u = uniforms[b, level, i], and tried only if q(x) > 0. r starts as the
    node's target distribution restricted to the draft vocabulary (the rest of its mass is
    carried as a scalar), q as its draft distribution; a rejection sets r to
    normalise(max(r - q, 0)) (unless that has no mass) and takes x out of q.

    Args:
        probs: [B, N, V] float32 the target's distribution at every node.
        parent: [B, N] int64 each node's parent (root 0 at node 0).
        node_row: [B, N] int64 each node's row of draft_probs (-1: it drafted nothing).
        node_draft_id: [B, N] int64 each node's token as a draft id.
        draft_probs: [B, R, V_draft] float32 the draft distributions.
        draft_to_target: [V_draft] int64 the target id of every draft id.
        uniforms: [B, D, K] float32 uniforms in [0, 1): the walk's depth D and tries K.
    Returns:
        path [B, D + 1] int64 (node per level; a row that stopped repeats its last node),
        num_accepted [B] int64, and the residual where each row stopped: [B, V_draft]
        float32 on the draft vocabulary and [B] float32 its mass outside it (a row that
        accepted D drafts: its last node's target distribution, split the same way).
    """
    args = (probs, parent, node_row, node_draft_id, draft_probs, draft_to_target, uniforms)
    check_rejection_walk_inputs(*args)
    # The op body is also its fake impl and what torch.compile inlines: non-CUDA tensors
    # (CPU, meta), and any tensors without Triton, take the reference.
    if not uses_triton(probs.device):
        return rejection_walk_ref(*args)
    # Imported here, not at the top: this module must load where Triton is missing.
    from .rejection_triton import launch_rejection_walk

    return launch_rejection_walk(*(t.contiguous() for t in args))


@rejection_walk.register_kernel("cpu")
def _rejection_walk_cpu(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The op on the CPU: the reference."""
    check_rejection_walk_inputs(*args)
    return rejection_walk_ref(*args)


def rejection_walk_ref(
    probs, parent, node_row, node_draft_id, draft_probs, draft_to_target, uniforms
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `rt::rejection_walk`: every row through every level and try, masked."""
    batch, num_nodes, _ = probs.shape
    _, depth, topk = uniforms.shape
    device = probs.device
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros_like(current)
    path = [current]
    not_root = torch.arange(num_nodes, device=device) > 0
    stopped_r = torch.zeros(batch, draft_probs.shape[-1], device=device)
    stopped_r_out = torch.zeros(batch, device=device)
    for level in range(depth):
        r, r_out = split_mass(probs[rows, current], draft_to_target)
        q = draft_probs[rows, node_row[rows, current].clamp_min(0)]
        moved = torch.zeros_like(alive)
        nxt = current
        is_child = (parent == current[:, None]) & not_root
        rank = is_child.long().cumsum(1) - 1
        for i in range(topk):
            slot = is_child & (rank == i)
            node = slot.int().argmax(-1)
            x = node_draft_id[rows, node]
            q_x, r_x = q[rows, x], r[rows, x]
            tries = alive & ~moved & slot.any(-1) & (q_x > 0)
            take = tries & (uniforms[:, level, i] * q_x < r_x)
            nxt = torch.where(take, node, nxt)
            moved |= take
            r, r_out, q = _reject(r, r_out, q, x, tries & ~take)
        stop = alive & ~moved
        stopped_r = torch.where(stop[:, None], r, stopped_r)
        stopped_r_out = torch.where(stop, r_out, stopped_r_out)
        alive &= moved
        current = nxt
        num_accepted += moved.long()
        path.append(current)
    r, r_out = split_mass(probs[rows, current], draft_to_target)
    stopped_r = torch.where(alive[:, None], r, stopped_r)
    stopped_r_out = torch.where(alive, r_out, stopped_r_out)
    return torch.stack(path, dim=1), num_accepted, stopped_r, stopped_r_out


def split_mass(p: torch.Tensor, draft_to_target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """p [B, V] -> (its mass on each draft id [B, V_draft], its mass outside them [B])."""
    r = p.index_select(1, draft_to_target)
    return r, (1 - r.sum(-1)).clamp_min(0)


def _reject(r, r_out, q, x, rejected):
    """Where `rejected` (a draw x [B] from q): r <- normalise(max(r - q, 0)), the mass outside
    the draft vocabulary (r_out [B], which q never covers) renormalised with it, and x leaves
    q. A residual of no mass (r == q up to rounding, so x was accepted but for rounding) keeps
    r as it was."""
    tiny = torch.finfo(r.dtype).tiny
    residual = (r - q).clamp_min(0)
    total = residual.sum(-1) + r_out
    keep = ~rejected | (total <= tiny)
    total = total.clamp_min(tiny)
    q_left = q.scatter(1, x[:, None], 0.0)
    q_left = q_left / q_left.sum(-1, keepdim=True).clamp_min(tiny)
    return (
        torch.where(keep[:, None], r, residual / total[:, None]),
        torch.where(keep, r_out, r_out / total),
        torch.where(keep[:, None], q, q_left),
    )
