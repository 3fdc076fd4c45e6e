"""`rt::acceptance_signals`: what a round's root tells about its draft, in one launch.

Every speculative round reports, at the root and at temperature 1, the draft's confidence
(its top probability) and the KL divergence KL(p || q) of its distribution q from the
target's p restricted to the draft vocabulary and renormalised there (DSDE's signal); the
cost policy's acceptance estimates read them (runtime/acceptance.py). In plain PyTorch
(`acceptance_signals_ref`) that is a gather of the root's target logits at the draft's ids, a
log-softmax over them and three reductions, which a compiled round runs as four or five
small kernels (Inductor splits the gathered row's reductions).

The Triton kernel runs one program per row over the draft vocabulary in chunks, with an
online log-sum-exp: per lane the running maximum m of the gathered target logits t, S =
sum exp(t - m) and A = sum exp(t - m) * (t - log q), rescaled when m grows; then
KL = A / S - m - log S, since log p = t - m - log S. Entries the target rules out (t = -inf)
add nothing; a draft log-probability of -inf where the target has mass makes KL infinite,
reported clamped as the reference does (1e3); a row with no finite target logit gives 0.

The kernel lives in acceptance_signals_triton.py, imported at the first launch, so this
module loads without Triton, where the op runs the reference on every device (_triton.py).
"""

from __future__ import annotations

import torch

from ._triton import rt_op, uses_triton

# The KL divergence is reported clamped to [0, MAX_KL] (an infinite one as MAX_KL).
MAX_KL = 1e3


def check_acceptance_signals_inputs(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    draft_log_norm: torch.Tensor,
) -> None:
    """Raise ValueError unless `rt::acceptance_signals` takes these arguments."""
    op = "rt::acceptance_signals"
    if target_logits.dim() != 2 or draft_logits.dim() != 2:
        raise ValueError(
            f"{op} takes target logits [B, V] and draft logits [B, V_draft], got "
            f"{tuple(target_logits.shape)} and {tuple(draft_logits.shape)}"
        )
    batch, num_draft = draft_logits.shape
    if target_logits.shape[0] != batch or num_draft == 0:
        raise ValueError(
            f"{op} takes one row of each per slot and a draft vocabulary, got "
            f"{tuple(target_logits.shape)} and {tuple(draft_logits.shape)}"
        )
    if not (target_logits.is_floating_point() and draft_logits.is_floating_point()):
        raise ValueError(f"{op} takes floating-point logits")
    if draft_to_target.shape != (num_draft,) or draft_to_target.dtype != torch.int64:
        raise ValueError(
            f"{op} takes draft_to_target [{num_draft}] int64, got "
            f"{tuple(draft_to_target.shape)} {draft_to_target.dtype}"
        )
    if draft_log_norm.shape != (batch,) or draft_log_norm.dtype != torch.float32:
        raise ValueError(
            f"{op} takes draft_log_norm [{batch}] float32, got {tuple(draft_log_norm.shape)} "
            f"{draft_log_norm.dtype}"
        )


def acceptance_signals(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    draft_log_norm: torch.Tensor,
) -> torch.Tensor:
    """The draft's confidence and KL(p || q) at the root (`rt::acceptance_signals`).

    Args:
        target_logits: [B, V] the target's logits at the root, any float dtype and strides
            with contiguous rows.
        draft_logits: [B, V_draft] the draft's, rows contiguous.
        draft_to_target: [V_draft] int64 the target id of every draft id (each < V).
        draft_log_norm: [B] float32 logsumexp of each row of draft_logits.
    Returns:
        [B, 2] float32: exp(max log q) and KL(p || q) clamped to [0, MAX_KL] (NaN read as 0).
    Raises:
        ValueError: for other ranks, shapes or dtypes.
    """
    return torch.ops.rt.acceptance_signals(
        target_logits, draft_logits, draft_to_target, draft_log_norm
    )


def acceptance_signals_ref(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    draft_log_norm: torch.Tensor,
) -> torch.Tensor:
    """Plain-PyTorch `rt::acceptance_signals`. Renormalised on the draft vocabulary, p's
    log-softmax over the whole vocabulary cancels: one reduction over the gathered logits,
    not two more over every target logit."""
    log_q = draft_logits.float() - draft_log_norm[:, None]
    log_p = target_logits.index_select(-1, draft_to_target).float().log_softmax(-1)
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    confidence = log_q.amax(-1).exp()
    return torch.stack([confidence, kl.nan_to_num(0.0).clamp(0.0, MAX_KL)], dim=-1)


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@rt_op("rt::acceptance_signals")
def _acceptance_signals_op(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    draft_log_norm: torch.Tensor,
) -> torch.Tensor:
    check_acceptance_signals_inputs(target_logits, draft_logits, draft_to_target, draft_log_norm)
    if not uses_triton(target_logits.device):
        return acceptance_signals_ref(target_logits, draft_logits, draft_to_target, draft_log_norm)
    # Imported here, not at the top: this module must load where Triton is missing.
    from .acceptance_signals_triton import launch_acceptance_signals

    return launch_acceptance_signals(
        _contiguous_rows(target_logits), _contiguous_rows(draft_logits), draft_to_target,
        draft_log_norm,
    )  # fmt: skip


@_acceptance_signals_op.register_kernel("cpu")
def _acceptance_signals_cpu(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    draft_log_norm: torch.Tensor,
) -> torch.Tensor:
    """The op on the CPU: the reference."""
    check_acceptance_signals_inputs(target_logits, draft_logits, draft_to_target, draft_log_norm)
    return acceptance_signals_ref(target_logits, draft_logits, draft_to_target, draft_log_norm)
