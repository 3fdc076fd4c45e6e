"""Online distillation of a draft head: the training loop and its held-out estimate.

The head starts fresh or from a saved one (heads.py). Each step samples a batch of
self-distilled sequences (data.py), runs the frozen target once over it (hidden states, taps,
logits), unrolls the head for `num_ttt_steps` training-time-test steps through its normal
forward and takes one AdamW step on the head's own parameters (losses.py). The target's
embedding / lm_head that heads borrow stay frozen. A checkpoint (checkpoint.py: head state +
optimizer + step, and the training and held-out sequences) lands in `out/checkpoint` every
`checkpoint_interval` steps; batches are a pure function of (seed, step), so a resumed run
continues exactly where the saved one stood. The finished head is
written to `out` with `save_draft` (published layout), loadable by
`Engine.from_pretrained(model, draft=out)`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ...models.config import DRAFT_KINDS
from ...models.eagle import DraftHead
from ...models.llama import Llama
from ...models.loading import save_draft
from .checkpoint import (
    checkpoint_heldout_path,
    checkpoint_sequences_path,
    load_checkpoint,
    save_checkpoint,
)
from .data import TrainingSequence, iter_batches, sample_batch, save_sequences
from .heads import build_head, initial_head
from .losses import (
    first_features,
    run_target,
    step_loss,
    target_scores,
    top1_agreement,
    unroll,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """How a head is trained.

    kind: "eagle3", "eagle1" or "dense".
    num_layers: attention layers of a dense or eagle3 head (eagle1 heads have one). None: one
        for a fresh head, the loaded head's with `init_from`; more than the loaded head's
        appends layers that start as the identity (models/eagle.py `add_layers`).
    num_ttt_steps: training-time-test unroll depth K (1 = plain teacher forcing).
    ttt_decay: weight of unroll step k is ttt_decay**k.
    draft_vocab_size: EAGLE-3 draft vocabulary: the most frequent response tokens (None:
        min(32000, target vocab) for a fresh head, the loaded head's own with `init_from`).
    num_warmup_steps: linear learning-rate warm-up, then cosine decay to 10% over num_steps.
    checkpoint_interval / eval_interval: steps between checkpoints / held-out estimates.
    num_heldout: sequences kept out of training for the acceptance estimate (the last of the
        training data, or the first of a held-out set given to `train_draft`).
    max_length: sequences are truncated to this many tokens.
    length_groups: steps come in runs of this many whose batches are cut from one draw sorted
        by length into batches of about equal response tokens (data.py `sample_batch`), so a
        batch pads less; 1: every batch a random draw.
    """

    kind: str = "eagle3"
    num_steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-4
    num_warmup_steps: int = 0
    num_ttt_steps: int = 7
    ttt_decay: float = 0.8
    draft_vocab_size: int | None = None
    num_layers: int | None = None
    max_grad_norm: float = 0.5
    checkpoint_interval: int = 200
    eval_interval: int = 100
    num_heldout: int = 8
    max_length: int = 2048
    length_groups: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"kind {self.kind!r} is not a draft kind; use one of {DRAFT_KINDS}")
        positive = ("num_steps", "batch_size", "num_ttt_steps", "num_layers", "max_length")
        positive += ("checkpoint_interval", "eval_interval", "length_groups")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 < self.ttt_decay <= 1 or self.max_grad_norm <= 0:
            raise ValueError("lr and max_grad_norm must be > 0 and ttt_decay in (0, 1]")
        if self.num_warmup_steps < 0 or self.num_heldout < 0:
            raise ValueError("num_warmup_steps and num_heldout must be >= 0")
        if self.draft_vocab_size is not None and self.kind != "eagle3":
            raise ValueError("draft_vocab_size applies to eagle3 heads only")
        if self.kind == "eagle1" and self.num_layers not in (None, 1):
            raise ValueError("num_layers applies to dense and eagle3 heads, eagle1 heads have one")


@dataclass
class TrainResult:
    """The trained head (float32, train mode off), losses per step run, and the held-out
    top-1 agreement per unroll step at each evaluation as (step, [agreement per step]); step
    0 is a fine-tuned head before training."""

    head: DraftHead
    losses: list[float] = field(default_factory=list)
    heldout: list[tuple[int, list[float]]] = field(default_factory=list)


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay from lr to lr / 10 at num_steps."""
    if step < config.num_warmup_steps:
        return config.lr * (step + 1) / config.num_warmup_steps
    span = max(1, config.num_steps - config.num_warmup_steps)
    progress = min(1.0, (step - config.num_warmup_steps) / span)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(target: Llama) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA, and on a CPU whose target is in bf16 (the head's float32
    master weights meet the target's bf16 taps and embeddings); plain float32 otherwise."""
    weight = target.lm_head.weight
    if weight.device.type == "cuda" or weight.dtype == torch.bfloat16:
        return torch.autocast(weight.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_loss(
    head: DraftHead, target: Llama, batch, *, config: TrainConfig
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The decay-weighted training loss of one Batch (on the head's device) and the
    per-step losses (detached)."""
    target_pass = run_target(target, batch.tokens)
    features = first_features(head, target_pass)
    scores = target_scores(head, target_pass.logits)
    hidden = target_pass.hidden
    del target_pass  # frees the full-vocabulary logits: the scores hold what the steps read
    total, weights, per_step = 0.0, 0.0, []
    outs = unroll(head, batch.tokens, features, num_steps=config.num_ttt_steps)
    for step, out in enumerate(outs):
        loss = step_loss(head, out, scores, hidden, batch.loss_mask, step=step)
        weight = config.ttt_decay**step
        total, weights = total + weight * loss, weights + weight
        per_step.append(loss.detach())
    return total / weights, per_step


@torch.no_grad()
def heldout_agreement(
    head: DraftHead,
    target: Llama,
    sequences: Sequence[TrainingSequence],
    *,
    config: TrainConfig,
) -> list[float]:
    """Top-1 agreement of draft and target per unroll step over `sequences` (a stand-in for
    the acceptance rate of a chain draft at that depth)."""
    device = target.lm_head.weight.device
    agree = [0] * config.num_ttt_steps
    total = [0] * config.num_ttt_steps
    batches = iter_batches(sequences, batch_size=config.batch_size, max_length=config.max_length)
    for batch in batches:
        batch = batch.to(device)
        with _autocast(target):
            target_pass = run_target(target, batch.tokens)
            features = first_features(head, target_pass)
            target_top1 = target_pass.logits.argmax(-1)
            outs = unroll(head, batch.tokens, features, num_steps=config.num_ttt_steps)
            for step, out in enumerate(outs):
                hits, count = top1_agreement(head, out, target_top1, batch.loss_mask, step=step)
                agree[step] += hits
                total[step] += count
    return [a / t if t else 0.0 for a, t in zip(agree, total, strict=True)]


def expected_accepted_length(agreement: Sequence[float]) -> float:
    """Tokens per round of a chain draft whose step-k proposal is accepted with probability
    agreement[k] given its parents were: 1 + sum_k prod_{i<=k} agreement[i]."""
    length, survive = 1.0, 1.0
    for rate in agreement:
        survive *= rate
        length += survive
    return length


def split_heldout(
    sequences: Sequence[TrainingSequence],
    *,
    config: TrainConfig,
    heldout: Sequence[TrainingSequence] | None = None,
) -> tuple[list[TrainingSequence], list[TrainingSequence]]:
    """(training, held-out): the first num_heldout of `heldout` when given (every sequence
    trains), else the last num_heldout sequences, keeping at least one for training."""
    if heldout is not None:
        return list(sequences), list(heldout[: config.num_heldout])
    num_heldout = min(config.num_heldout, len(sequences) - 1)
    if num_heldout <= 0:
        return list(sequences), []
    return list(sequences[:-num_heldout]), list(sequences[-num_heldout:])


def train_draft(
    target: Llama,
    sequences: Sequence[TrainingSequence],
    *,
    config: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
    max_seconds: float | None = None,
    progress: bool = True,
    save_dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    init_from: str | Path | None = None,
    heldout: Sequence[TrainingSequence] | None = None,
) -> TrainResult:
    """Train a head of `config.kind` on `sequences` with `target` frozen; write it to out_dir.

    `init_from`: a head directory to start from instead of fresh weights (fine-tuning a
    shipped head on more data); its kind must match. An EAGLE-3 head keeps its draft
    vocabulary unless `config.draft_vocab_size` is set, which redraws one of that size from
    the training sequences (`initial_head`).
    A larger `config.num_layers` than it has trains a deeper head that starts out computing
    what it does (see `initial_head`).

    With `resume`, head/optimizer/step come from out_dir/checkpoint and training continues
    at the saved step (the same batches follow as in an uninterrupted run). `stop_at` (a
    step) and `max_seconds` (wall time) end a time-sliced run early with a checkpoint, to be
    continued with `resume`; the head written to out_dir is then the one trained so far.
    `save_dtype` and `max_shard_bytes` shape that written head (see `save_draft`); training
    and checkpoints stay in float32.

    `heldout`: sequences to measure the held-out agreement on (the first `num_heldout`)
    instead of the last of `sequences`, which then all train: the same set across runs makes
    their agreements comparable. A fine-tune (`init_from`) is also measured before its first
    step, the figure it has to beat.
    """
    out_dir = Path(out_dir)
    if init_from is not None and resume:
        raise ValueError("resume continues from out_dir's checkpoint; do not also give init_from")
    target.requires_grad_(False)
    train_set, heldout_set = split_heldout(sequences, config=config, heldout=heldout)
    if init_from is None:
        head = build_head(target, config, train_set)
    else:
        head = initial_head(target, config, init_from, train_set)
    optimizer = new_optimizer(head, config)
    start = load_checkpoint(out_dir, head, optimizer) if resume else 0
    if not resume:
        save_sequences(sequences, checkpoint_sequences_path(out_dir))
        if heldout is not None:
            save_sequences(heldout_set, checkpoint_heldout_path(out_dir))
    result = TrainResult(head)
    if heldout_set and init_from is not None:
        _evaluate(head, target, heldout_set, 0, result, config=config)
    bar = tqdm(range(start, config.num_steps), initial=start, total=config.num_steps,
               disable=not progress, desc=f"train {config.kind}")  # fmt: skip
    head.train()
    started = time.monotonic()
    for step in bar:
        loss = train_step(head, target, optimizer, train_set, step, config=config)
        result.losses.append(loss)
        postfix = {"loss": f"{loss:.4f}"}
        evaluating = (step + 1) % config.eval_interval == 0 or step + 1 == config.num_steps
        if heldout_set and evaluating:
            postfix |= _evaluate(head, target, heldout_set, step + 1, result, config=config)
        bar.set_postfix(postfix)
        out_of_time = max_seconds is not None and time.monotonic() - started > max_seconds
        stopping = out_of_time or step + 1 == stop_at
        if stopping or (step + 1) % config.checkpoint_interval == 0 or step + 1 == config.num_steps:
            save_checkpoint(out_dir, head, optimizer, step + 1, config)
        if stopping:
            logger.info("stopped at step %d of %d (resume continues)", step + 1, config.num_steps)
            break
    bar.close()
    head.eval()
    save_draft(head, out_dir, dtype=save_dtype, max_shard_bytes=max_shard_bytes)
    return result


def _evaluate(head, target, heldout, step: int, result: TrainResult, *, config) -> dict:
    """Held-out agreement at `step`: recorded in `result`, logged, returned for the bar."""
    agreement = heldout_agreement(head, target, heldout, config=config)
    result.heldout.append((step, agreement))
    length = expected_accepted_length(agreement)
    logger.info("step %d: held-out top-1 agreement %s, chain length %.2f", step, agreement, length)
    head.train()
    return {"acc": f"{agreement[0]:.3f}", "len": f"{length:.2f}"}


def new_optimizer(head: DraftHead, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of the head's parameters (its learning rate is set every step)."""
    return torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)


def train_step(
    head: DraftHead,
    target: Llama,
    optimizer: torch.optim.Optimizer,
    train_set: Sequence[TrainingSequence],
    step: int,
    *,
    config: TrainConfig,
) -> float:
    """One optimizer step of `head` on the batch that (config.seed, step) draws from
    `train_set`, the target frozen; returns the loss (a host sync)."""
    device = target.lm_head.weight.device
    batch = sample_batch(
        train_set,
        batch_size=config.batch_size,
        max_length=config.max_length,
        seed=config.seed,
        step=step,
        length_groups=config.length_groups,
    ).to(device)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, step)
    with _autocast(target):
        loss, _ = batch_loss(head, target, batch, config=config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), config.max_grad_norm)
    optimizer.step()
    return float(loss.detach())
