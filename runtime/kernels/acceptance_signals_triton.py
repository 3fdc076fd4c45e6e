"""The Triton kernel of `rt::acceptance_signals` and its launcher.

Imported only where Triton is installed, by the op's CUDA path in acceptance_signals.py (and
by the TRITON_INTERPRET tests): acceptance_signals.py states the method and holds the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import wrap
from .acceptance_signals import MAX_KL

# Draft-vocabulary entries a program reads a step: a 14,336-entry row in 4 steps of 8 warps.
_BLOCK = 4096
_NUM_WARPS = 8


@triton.jit
def _acceptance_signals_kernel(
    target_ptr, draft_ptr, ids_ptr, norm_ptr, out_ptr, num_draft, stride_t, stride_d,
    MAX_KL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[row] = (exp(max log q), KL(p || q)) for one row: lanes keep a running maximum m
    of the gathered target logits t, S = sum exp(t - m) and A = sum exp(t - m) (t - log q),
    merged over lanes at the end (acceptance_signals.py)."""
    row = tl.program_id(0)
    log_norm = tl.load(norm_ptr + row)
    lanes = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    a = tl.zeros((BLOCK,), tl.float32)
    unbounded = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, num_draft, BLOCK):
        cols = start + lanes
        ok = cols < num_draft
        ids = tl.load(ids_ptr + cols, mask=ok, other=0)
        t = tl.load(target_ptr + row * stride_t + ids, mask=ok, other=float("-inf"))
        t = t.to(tl.float32)
        q = tl.load(draft_ptr + row * stride_d + cols, mask=ok, other=float("-inf"))
        log_q = q.to(tl.float32) - log_norm
        top = tl.maximum(top, log_q)
        has_mass = t > float("-inf")
        unbounded = unbounded | (has_mass & (log_q == float("-inf"))).to(tl.int32)
        grown = tl.maximum(m, t)
        # exp(-inf - -inf) is NaN: a lane that has seen no finite logit keeps S = A = 0.
        keep = tl.where(m > float("-inf"), tl.exp(m - grown), 0.0)
        weight = tl.where(has_mass, tl.exp(t - grown), 0.0)
        gap = tl.where(has_mass & (log_q > float("-inf")), t - log_q, 0.0)
        s = s * keep + weight
        a = a * keep + weight * gap
        m = grown
    peak = tl.max(m, 0)
    lane_scale = tl.where(m > float("-inf"), tl.exp(m - peak), 0.0)
    total = tl.sum(s * lane_scale, 0)
    kl = tl.sum(a * lane_scale, 0) / total - peak - tl.log(total)
    kl = tl.where(kl == kl, kl, 0.0)  # no finite target logit: NaN, read as 0
    kl = tl.where(tl.max(unbounded, 0) > 0, MAX_KL, tl.minimum(tl.maximum(kl, 0.0), MAX_KL))
    tl.store(out_ptr + row * 2, tl.exp(tl.max(top, 0)))
    tl.store(out_ptr + row * 2 + 1, kl)


def launch_acceptance_signals(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    draft_log_norm: torch.Tensor,
) -> torch.Tensor:
    """Run the kernel, one program per row, on inputs acceptance_signals.py has checked
    (rows contiguous). Returns [B, 2] float32."""
    batch, num_draft = draft_logits.shape
    out = torch.empty((batch, 2), dtype=torch.float32, device=draft_logits.device)
    wrap(_acceptance_signals_kernel)[(batch,)](
        target_logits, draft_logits, draft_to_target, draft_log_norm, out, num_draft,
        target_logits.stride(0), draft_logits.stride(0),
        MAX_KL=MAX_KL, BLOCK=_BLOCK, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out
