"""The training loss (the target scored once a batch) and the held-out agreement against a
reference that scores every unroll step from the shifted full-vocabulary logits: the same
losses, gradients and agreement counts for every head kind, on a padded batch shorter than
the unroll."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specrun.runtime.distill.data import TrainingSequence, make_batch
from specrun.runtime.distill.losses import (
    EAGLE1_CE_WEIGHT,
    first_features,
    run_target,
    shift_left,
    top1_agreement,
    unroll,
)
from specrun.runtime.distill.trainer import TrainConfig, batch_loss
from tiny_models import random_head, random_llama, tiny_config

NUM_STEPS = 7


def _batch():
    """Three rows of 7, 5 and 3 tokens (prompts of 2, 1 and 1): padded to 7, shorter than
    seven unroll steps need."""
    generator = torch.Generator().manual_seed(11)
    rows = [(7, 2), (5, 1), (3, 1)]
    sequences = [
        TrainingSequence(tuple(torch.randint(97, (n,), generator=generator).tolist()), p)
        for n, p in rows
    ]
    return make_batch(sequences, max_length=64)


def _reference_step_loss(head, out, target_pass, loss_mask, step):
    """Unroll step `step` scored from the full logits shifted to its positions."""
    logits = shift_left(target_pass.logits, 1 + step)
    valid = shift_left(loss_mask, 2 + step)
    log_q = out.logits.float().log_softmax(-1)
    if head.config.kind == "eagle3":
        draft_ids = torch.arange(out.logits.shape[-1])
        valid = valid & head.t2d[logits.argmax(-1)]
        logits = logits[..., head.to_target_ids(draft_ids)]
    log_p = logits.float().log_softmax(-1)
    if head.config.kind == "eagle1":
        hidden = shift_left(target_pass.hidden, 1 + step)
        regression = F.smooth_l1_loss(out.hidden.float(), hidden.float(), reduction="none")
        values = regression.mean(-1) - EAGLE1_CE_WEIGHT * (log_p.exp() * log_q).sum(-1)
    else:
        values = (log_p.exp() * (log_p - log_q)).sum(-1)
    mask = valid.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def _reference_loss(head, target, batch):
    target_pass = run_target(target, batch.tokens)
    features = first_features(head, target_pass)
    outs = unroll(head, batch.tokens, features, num_steps=NUM_STEPS)
    losses = [
        _reference_step_loss(head, out, target_pass, batch.loss_mask, step)
        for step, out in enumerate(outs)
    ]
    weights = [0.8**step for step in range(NUM_STEPS)]
    return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights), losses


def _gradients(head, loss):
    head.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "dense"])
def test_scores_read_once_give_the_per_step_losses_and_gradients(kind):
    target = random_llama(tiny_config(), seed=5, dtype=torch.float64)
    head = random_head(kind, target, seed=6)
    batch = _batch()
    config = TrainConfig(kind=kind, num_ttt_steps=NUM_STEPS, ttt_decay=0.8)
    loss, per_step = batch_loss(head, target, batch, config=config)
    want_loss, want_per_step = _reference_loss(head, target, batch)
    torch.testing.assert_close(torch.stack(per_step), torch.stack(want_per_step).detach())
    assert per_step[0] > 0 and per_step[-1] == 0  # the last steps predict past every row
    got, want = _gradients(head, loss), _gradients(head, want_loss)
    assert got.keys() == want.keys() and got
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], msg=name)


@pytest.mark.parametrize("kind", ["eagle3", "dense"])
def test_top1_agreement_counts_the_reference_positions(kind):
    target = random_llama(tiny_config(), seed=7, dtype=torch.float64)
    head = random_head(kind, target, seed=8)
    batch = _batch()
    with torch.no_grad():
        target_pass = run_target(target, batch.tokens)
        target_top1 = target_pass.logits.argmax(-1)
        features = first_features(head, target_pass)
        outs = list(unroll(head, batch.tokens, features, num_steps=NUM_STEPS))
    for step, out in enumerate(outs):
        logits = shift_left(target_pass.logits, 1 + step)
        valid = shift_left(batch.loss_mask, 2 + step)
        draft_top = head.to_target_ids(out.logits.argmax(-1))
        want = (int(((draft_top == logits.argmax(-1)) & valid).sum()), int(valid.sum()))
        assert top1_agreement(head, out, target_top1, batch.loss_mask, step=step) == want
