"""The head a training run starts from: a fresh one, or a saved one made to fit the run.

A fresh EAGLE-3 head drafts over the most frequent response tokens of the training data and
starts its lm_head from the target's rows of them. A saved head (`--init-from`) is loaded in
float32 and, where the run asks, given a new draft vocabulary (its drafted tokens keep their
rows) or more layers (starting as the identity).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...models.config import DraftConfig
from ...models.eagle import DraftHead, Eagle3Head, add_layers, build_draft, with_draft_vocab
from ...models.llama import Llama
from ...models.loading import load_draft
from .data import TrainingSequence, token_frequencies
from .data import draft_vocab as build_draft_vocab

if TYPE_CHECKING:
    from .trainer import TrainConfig

logger = logging.getLogger(__name__)


def build_head(
    target: Llama, config: TrainConfig, sequences: Sequence[TrainingSequence]
) -> DraftHead:
    """A fresh float32 head for `target` on its device. EAGLE-3 heads get the draft
    vocabulary of the sequences' most frequent response tokens and an lm_head initialised
    from the target's rows of those tokens (when the widths match)."""
    vocab = target.config.vocab_size
    draft_vocab = None
    if config.kind == "eagle3":
        draft_vocab = config.draft_vocab_size or min(32000, vocab)
    draft_config = DraftConfig(
        kind=config.kind,
        layer=target.config,
        num_layers=config.num_layers or 1,
        draft_vocab_size=draft_vocab,
        tap_layers=target.tap_layers if config.kind == "eagle3" else None,
    )
    device = target.lm_head.weight.device
    torch.manual_seed(config.seed)
    with torch.device(device):
        head = build_draft(draft_config, target).float()
    if isinstance(head, Eagle3Head):
        _init_draft_vocab(head, target, token_frequencies(sequences, vocab_size=vocab))
    return head


def initial_head(
    target: Llama,
    config: TrainConfig,
    head_dir: str | Path,
    sequences: Sequence[TrainingSequence],
) -> DraftHead:
    """The head in `head_dir` in float32 on the target's device, checked against `config`.

    An EAGLE-3 head gets a new draft vocabulary of `config.draft_vocab_size` tokens when
    that is set: the most frequent response tokens of `sequences` (tokens it already drafts
    keep their trained lm_head rows, see `with_draft_vocab`). It is deepened to
    `config.num_layers` when that asks for more layers than it has.
    """
    head = load_draft(head_dir, target=target, dtype=torch.float32)
    if head.config.kind != config.kind:
        raise ValueError(
            f"{head_dir} holds an {head.config.kind} head, not {config.kind}; "
            f"train it with kind={head.config.kind!r} (--kind {head.config.kind})"
        )
    if config.draft_vocab_size is not None:
        head = _redraw_draft_vocab(head, target, sequences, size=config.draft_vocab_size)
    layers = head.num_layers
    if config.num_layers is None or config.num_layers == layers:
        return head
    if config.num_layers < layers:
        raise ValueError(
            f"{head_dir} holds a head of {layers} layers, not num_layers={config.num_layers}; "
            "leave it unset to keep them, or ask for more to add layers"
        )
    logger.info("adding %d layers to the %d of %s", config.num_layers - layers, layers, head_dir)
    torch.manual_seed(config.seed)
    return add_layers(head, num_layers=config.num_layers)


def _redraw_draft_vocab(
    head: Eagle3Head, target: Llama, sequences: Sequence[TrainingSequence], *, size: int
) -> Eagle3Head:
    """`head` over the `size` most frequent response tokens of `sequences`; tokens new to it
    start from the target's lm_head rows (or a fresh layer's when the widths differ)."""
    vocab = target.config.vocab_size
    d2t, _ = build_draft_vocab(token_frequencies(sequences, vocab_size=vocab), size=size)
    kept = (torch.arange(size) + d2t).to(head.lm_head.weight.device)
    width = head.lm_head.weight.shape[1]
    if target.lm_head.weight.shape[1] == width:
        new_rows = target.lm_head.weight[kept].float()
    else:
        new_rows = torch.nn.Linear(width, size, bias=False, device=kept.device).weight.detach()
    num_drafted = int(head.t2d[kept].sum())
    logger.info("draft vocabulary of %d tokens, %d of them drafted before", size, num_drafted)
    return with_draft_vocab(head, kept, new_rows=new_rows)


@torch.no_grad()
def _init_draft_vocab(head: Eagle3Head, target: Llama, frequencies: torch.Tensor) -> None:
    d2t, t2d = build_draft_vocab(frequencies, size=head.d2t.shape[0])
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    if head.lm_head.weight.shape[1] == target.lm_head.weight.shape[1]:
        kept = head.to_target_ids(torch.arange(head.d2t.shape[0], device=head.d2t.device))
        head.lm_head.weight.copy_(target.lm_head.weight[kept].float())
