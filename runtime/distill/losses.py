"""Training objectives of draft heads: the target pass, the training-time-test unroll, losses.

Conventions (those of inference, runtime/draft.py): draft position j holds the pair
(token j+1, feature of position j) and predicts token j+2. Training-time test (EAGLE-3)
unrolls K draft steps over a whole sequence at once: at step k, position j reads
(token j+1+k, the head's own hidden state of step k-1 at position j) at RoPE position j+k and
predicts token j+2+k, i.e. it plays a level-k tree node grown from the committed prefix
0..j. Its attention therefore sees the step-0 keys at positions <= j (the real features) and
the keys of steps 1..k at position j (its own chain), which is exactly an ancestor bitmask
over the keys of all steps so far; the head runs through its normal forward with
AttentionInputs, so training computes the function inference runs.

Losses per step k (averaged over steps with weight decay**k):
  eagle3  KL(target || draft) over the draft vocabulary, the target renormalised to it;
          positions whose target top-1 lies outside the draft vocabulary are skipped.
  eagle1  smooth L1(head hidden, target's next post-norm feature)
          + 0.1 * cross-entropy of target lm_head(head hidden) against the target distribution.
  dense   KL(target || draft) over the full vocabulary.
The target's side (its distribution over the scored ids and its entropy) is computed once a
batch (`target_scores`); step k reads it k+1 positions on, over the positions j < T-1-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...models.attention import chain_ancestors, pack_ancestor_mask
from ...models.eagle import DraftHead, DraftOutput, Eagle3Head
from ...models.llama import AttentionInputs, Llama

EAGLE1_CE_WEIGHT = 0.1


@dataclass
class TargetPass:
    """One target forward over a batch: hidden [B, T, H] post-norm, taps [B, T, 3H] or None,
    logits [B, T, V]; all without gradient."""

    hidden: torch.Tensor
    taps: torch.Tensor | None
    logits: torch.Tensor


def empty_attention(
    num_layers: int, batch: int, num_kv_heads: int, head_dim: int, *, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-slot all-masked KV cache [L, B, Hkv, 1, D] (dtype/device of `like`) and its
    lengths [B] (zeros): training forwards attend to their own keys only."""
    cache = like.new_zeros(num_layers, batch, num_kv_heads, 1, head_dim)
    return cache, torch.zeros(batch, dtype=torch.int64, device=like.device)


@torch.no_grad()
def run_target(target: Llama, tokens: torch.Tensor) -> TargetPass:
    """tokens: [B, T] int64, right-padded (causal attention keeps padding out of real rows)."""
    config = target.config
    batch, length = tokens.shape
    weight = target.lm_head.weight
    cache, cache_len = empty_attention(
        config.num_layers, batch, config.num_kv_heads, config.head_dim, like=weight
    )
    anc = chain_ancestors(batch, length, tokens.device)
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    out = target(tokens, positions, AttentionInputs(cache, cache, cache_len, anc))
    return TargetPass(out.hidden, out.taps, target.logits(out.hidden))


def ttt_ancestors(batch: int, length: int, step: int, device: torch.device | str) -> torch.Tensor:
    """Ancestor bitmask [B, T, W] of unroll step `step` over the keys of steps 0..step (each
    `length` keys, in step order): causal over step 0, the same position in later steps."""
    if step == 0:
        return chain_ancestors(batch, length, device)
    idx = torch.arange(length, device=device)
    causal = idx[None, :] <= idx[:, None]
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    mask = torch.cat([causal, *[diagonal] * step], dim=1)
    return pack_ancestor_mask(mask).expand(batch, length, -1)


def shift_left(x: torch.Tensor, num: int) -> torch.Tensor:
    """x: [B, T, ...]. Returns x[:, num:] zero-padded back to length T."""
    if num == 0:
        return x
    pad = x.new_zeros(x.shape[0], min(num, x.shape[1]), *x.shape[2:])
    return torch.cat([x[:, num:], pad], dim=1)


def first_features(head: DraftHead, target_pass: TargetPass) -> torch.Tensor:
    """Step-0 features [B, T, H]: projected taps (EAGLE-3, with gradient to `fc`) or the
    target's post-norm hidden state."""
    if isinstance(head, Eagle3Head):
        return head.project(target_pass.taps)
    return target_pass.hidden


def unroll(
    head: DraftHead, tokens: torch.Tensor, features: torch.Tensor, *, num_steps: int
) -> Iterator[DraftOutput]:
    """Run `num_steps` training-time-test steps (see the module docstring).

    Args:
        tokens: [B, T] int64 target ids (the full sequences; step k reads tokens[:, 1+k:]).
        features: [B, T, H] step-0 features (`first_features`).
    Yields:
        each step's DraftOutput (hidden [B, T, H], logits [B, T, V_draft]).
    """
    batch, length = tokens.shape
    layer = head.config.layer
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    cache, cache_len = empty_attention(
        head.num_layers,
        batch,
        layer.num_kv_heads,
        layer.head_dim,
        like=features.new_empty(0, dtype=_compute_dtype(features)),
    )
    k_side = v_side = None
    for step in range(num_steps):
        anc = ttt_ancestors(batch, length, step, tokens.device)
        attn = AttentionInputs(cache, cache, cache_len, anc, k_side, v_side)
        out = head(shift_left(tokens, 1 + step), features, positions + step, attn)
        yield out
        k_side, v_side = out.k_tree, out.v_tree
        features = out.hidden


def _compute_dtype(features: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(features.device.type):
        return torch.get_autocast_dtype(features.device.type)
    return features.dtype


@dataclass
class TargetScores:
    """What every unroll step of one batch is scored against, computed once from the target
    pass (`target_scores`, no gradient); position j holds the target's view of token j+1.

    probs: [B, T, V'] float32, the target's next-token distribution over the ids the head
        scores (an EAGLE-3 head's draft vocabulary, renormalised; the whole vocabulary
        otherwise).
    neg_entropy: [B, T] float32, sum over V' of probs * log(probs).
    scored: [B, T] bool, positions a loss counts (EAGLE-3: top-1 inside the draft vocabulary).
    """

    probs: torch.Tensor
    neg_entropy: torch.Tensor
    scored: torch.Tensor


@torch.no_grad()
def target_scores(head: DraftHead, target_logits: torch.Tensor) -> TargetScores:
    """target_logits: [B, T, V] (TargetPass.logits). Once a batch instead of once a step:
    the unroll's steps read the same positions shifted, and the full-vocabulary logits can
    go once these are taken."""
    if isinstance(head, Eagle3Head):
        draft_ids = torch.arange(head.d2t.shape[0], device=target_logits.device)
        scored = head.t2d[target_logits.argmax(-1)]
        target_logits = target_logits[..., head.to_target_ids(draft_ids)]
    else:
        scored = torch.ones(target_logits.shape[:-1], dtype=torch.bool, device=target_logits.device)
    log_p = target_logits.float().log_softmax(-1)
    probs = log_p.exp()
    return TargetScores(probs, (probs * log_p).sum(-1), scored)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values, mask: [B, T]. Mean over the True entries (0 when there are none)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def step_loss(
    head: DraftHead,
    out: DraftOutput,
    scores: TargetScores,
    target_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    step: int,
) -> torch.Tensor:
    """The scalar loss of unroll step `step` (see the module docstring for each kind): at
    position j it predicts token j+2+step, scored against the target at position j+1+step.

    Args:
        out: the step's DraftOutput (hidden [B, T, H], logits [B, T, V_draft]).
        scores: the batch's TargetScores; target_hidden: [B, T, H] the target's post-norm
            hidden states (EAGLE-1's regression target); loss_mask: [B, T] bool
            (Batch.loss_mask).
    """
    shift, num = 1 + step, max(out.logits.shape[1] - 1 - step, 0)
    valid = _predicts_a_response(loss_mask, step, num) & scores.scored[:, shift:]
    log_q = out.logits[:, :num].float().log_softmax(-1)
    cross_entropy = -(scores.probs[:, shift:] * log_q).sum(-1)
    if head.config.kind == "eagle1":
        regression = F.smooth_l1_loss(
            out.hidden[:, :num].float(), target_hidden[:, shift:].float(), reduction="none"
        ).mean(-1)
        return masked_mean(regression + EAGLE1_CE_WEIGHT * cross_entropy, valid)
    return masked_mean(scores.neg_entropy[:, shift:] + cross_entropy, valid)  # KL(p || q)


def top1_agreement(
    head: DraftHead,
    out: DraftOutput,
    target_top1: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    step: int,
) -> tuple[int, int]:
    """(positions where unroll step `step`'s top-1, mapped to target ids, equals the
    target's, positions it predicts a response token at). out.logits: [B, T, V_draft];
    target_top1: [B, T] int64 (TargetPass.logits.argmax(-1)); loss_mask: [B, T] bool."""
    num = max(out.logits.shape[1] - 1 - step, 0)
    valid = _predicts_a_response(loss_mask, step, num)
    draft_top = head.to_target_ids(out.logits[:, :num].argmax(-1))
    agree = (draft_top == target_top1[:, 1 + step :]) & valid
    return int(agree.sum()), int(valid.sum())


def _predicts_a_response(loss_mask: torch.Tensor, step: int, num: int) -> torch.Tensor:
    """[B, num] bool: token j+2+step, which unroll step `step` predicts at position j,
    exists and is a response token."""
    return shift_left(loss_mask, 2 + step)[:, :num]
