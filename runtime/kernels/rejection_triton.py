"""The Triton kernel of `rt::rejection_walk` and its launcher.

Imported only where Triton is installed, by the op's CUDA path in rejection.py (and by the
TRITON_INTERPRET tests): rejection.py states the walk, what one program does
and how its numerics relate to `rejection_walk_ref`, which every other caller runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import wrap

_BLOCK = 2048
_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny


@triton.jit
def _start_level(p_row, q_row, d2t_ptr, r_ptr, q_ptr, draft_vocab_size, BLOCK: tl.constexpr):
    """Copy the node's target mass on each draft id (p[d2t]) to r and its draft
    distribution to q; return the target mass outside the draft vocabulary."""
    tl.debug_barrier()  # every thread is done reading the previous level's r and q
    mass = tl.full((), 0.0, tl.float32)
    for start in range(0, draft_vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < draft_vocab_size
        ids = tl.load(d2t_ptr + offsets, mask=valid, other=0)
        p = tl.load(p_row + ids, mask=valid, other=0.0)
        tl.store(r_ptr + offsets, p, mask=valid)
        tl.store(q_ptr + offsets, tl.load(q_row + offsets, mask=valid, other=0.0), mask=valid)
        mass += tl.sum(p, 0)
    tl.debug_barrier()
    return tl.maximum(1.0 - mass, 0.0)


@triton.jit
def _residual(
    r_ptr, r_scale, q_ptr, q_scale, out_ptr, x, draft_vocab_size, BLOCK: tl.constexpr
):  # fmt: skip
    """out = max(r / r_scale - q / q_scale, 0); returns (sum of out, sum of q without x)."""
    out_sum = tl.full((), 0.0, tl.float32)
    q_left = tl.full((), 0.0, tl.float32)
    for start in range(0, draft_vocab_size, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < draft_vocab_size
        r = tl.load(r_ptr + offsets, mask=valid, other=0.0)
        q = tl.load(q_ptr + offsets, mask=valid, other=0.0)
        out = tl.maximum(r / r_scale - q / q_scale, 0.0)
        tl.store(out_ptr + offsets, out, mask=valid)
        out_sum += tl.sum(out, 0)
        q_left += tl.sum(tl.where(offsets == x, 0.0, q), 0)
    return out_sum, q_left


@triton.jit
def _rejection_walk_kernel(
    probs_ptr, parent_ptr, node_row_ptr, node_draft_id_ptr, draft_probs_ptr, d2t_ptr,
    uniforms_ptr, path_ptr, num_accepted_ptr, residual_ptr, residual_out_ptr, scratch_ptr,
    num_nodes, vocab_size, draft_vocab_size, num_draft_rows,
    DEPTH: tl.constexpr, TOPK: tl.constexpr, NODES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program `row`: walk that row's tree (see `rejection_walk`). Scratch [B, 3, V_draft]
    holds two residual buffers (a rejection writes the other one, and keeps it unless the
    residual has no mass) and q."""
    row = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, NODES)
    parent = tl.load(parent_ptr + row * num_nodes + nodes, mask=nodes < num_nodes, other=-1)
    not_root = (nodes > 0) & (nodes < num_nodes)
    tree_row = row * num_nodes
    r_base = scratch_ptr + row * 3 * draft_vocab_size
    q_ptr = r_base + 2 * draft_vocab_size
    current = row * 0
    alive = row == row
    num_accepted = row * 0
    which = row * 0
    r_scale = tl.full((), 1.0, tl.float32)
    q_scale = tl.full((), 1.0, tl.float32)
    r_out = tl.full((), 0.0, tl.float32)
    tl.store(path_ptr + row * (DEPTH + 1), current)
    for level in range(DEPTH):
        moved = row != row
        nxt = current
        if alive:
            draft_row = tl.maximum(tl.load(node_row_ptr + tree_row + current), 0)
            r_out = _start_level(
                probs_ptr + (tree_row + current) * vocab_size,
                draft_probs_ptr + (row * num_draft_rows + draft_row) * draft_vocab_size,
                d2t_ptr, r_base + which * draft_vocab_size, q_ptr, draft_vocab_size, BLOCK,
            )  # fmt: skip
            r_scale = tl.full((), 1.0, tl.float32)
            q_scale = tl.full((), 1.0, tl.float32)
            is_child = (parent == current) & not_root
            rank = tl.cumsum(is_child.to(tl.int32), 0) - 1
            for i in range(TOPK):
                slot = is_child & (rank == i)
                node = tl.sum(tl.where(slot, nodes, 0), 0).to(tl.int64)
                x = tl.load(node_draft_id_ptr + tree_row + node)
                r_x = tl.load(r_base + which * draft_vocab_size + x) / r_scale
                q_x = tl.load(q_ptr + x) / q_scale
                if (~moved) & (tl.sum(slot.to(tl.int32), 0) > 0) & (q_x > 0):
                    u = tl.load(uniforms_ptr + (row * DEPTH + level) * TOPK + i)
                    if u * q_x < r_x:
                        moved = row == row
                        nxt = node
                    else:
                        out_sum, q_left = _residual(
                            r_base + which * draft_vocab_size, r_scale, q_ptr, q_scale,
                            r_base + (1 - which) * draft_vocab_size, x, draft_vocab_size, BLOCK,
                        )  # fmt: skip
                        tl.debug_barrier()  # every thread is done reading q[x]
                        total = out_sum + r_out
                        if total > _TINY:
                            which = 1 - which
                            r_scale = total
                            r_out = r_out / total
                            q_scale = tl.maximum(q_left, _TINY)
                            tl.store(q_ptr + x, 0.0)
                        tl.debug_barrier()
        alive = alive & moved
        current = nxt
        num_accepted += moved.to(tl.int64)
        tl.store(path_ptr + row * (DEPTH + 1) + level + 1, current)
    out_ptr = residual_ptr + row * draft_vocab_size
    if alive:
        # Every draft accepted: the bonus comes from the last node's whole distribution.
        draft_row = tl.maximum(tl.load(node_row_ptr + tree_row + current), 0)
        r_out = _start_level(
            probs_ptr + (tree_row + current) * vocab_size,
            draft_probs_ptr + (row * num_draft_rows + draft_row) * draft_vocab_size,
            d2t_ptr, out_ptr, q_ptr, draft_vocab_size, BLOCK,
        )  # fmt: skip
    else:
        for start in range(0, draft_vocab_size, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            valid = offsets < draft_vocab_size
            r = tl.load(r_base + which * draft_vocab_size + offsets, mask=valid, other=0.0)
            tl.store(out_ptr + offsets, r / r_scale, mask=valid)
    tl.store(residual_out_ptr + row, r_out)
    tl.store(num_accepted_ptr + row, num_accepted)


def launch_rejection_walk(
    probs, parent, node_row, node_draft_id, draft_probs, draft_to_target, uniforms
) -> tuple[torch.Tensor, ...]:
    """Run the Triton kernel (arguments as `rejection_walk`, contiguous). Used by the op and
    by the interpreter tests."""
    batch, num_nodes, vocab_size = probs.shape
    _, depth, topk = uniforms.shape
    num_draft_rows, draft_vocab_size = draft_probs.shape[1:]
    device = probs.device
    path = torch.empty(batch, depth + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    residual = torch.empty(batch, draft_vocab_size, dtype=torch.float32, device=device)
    residual_out = torch.empty(batch, dtype=torch.float32, device=device)
    scratch = torch.empty(batch, 3, draft_vocab_size, dtype=torch.float32, device=device)
    wrap(_rejection_walk_kernel)[(batch,)](
        probs, parent, node_row, node_draft_id, draft_probs, draft_to_target, uniforms,
        path, num_accepted, residual, residual_out, scratch,
        num_nodes, vocab_size, draft_vocab_size, num_draft_rows,
        DEPTH=depth, TOPK=topk, NODES=triton.next_power_of_2(num_nodes),
        BLOCK=min(_BLOCK, triton.next_power_of_2(draft_vocab_size)), num_warps=8,
    )  # fmt: skip
    return path, num_accepted, residual, residual_out
