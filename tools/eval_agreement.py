"""`specrun eval --sequences`: a head's teacher-forced agreement with its model on fixed text.

Instead of decoding prompts, the target runs over batches of finished sequences (written by
`specrun train-draft`, e.g. `--generate-only` answers to prompts no head trained on) and the
head is unrolled through `DRAFT_STEPS` draft steps over them, as training measures its
held-out set (runtime/distill/trainer.py, `heldout_agreement`). The result is the top-1
agreement per draft step and the tokens per round of a chain draft it implies. Every head
measured on one set sees the same text, so the figure orders heads without the drift of
decoding (in bf16 each head's verification steers greedy text differently), and a few dozen
sequences take about a minute on a CPU.
"""

from __future__ import annotations

import argparse
import json

from ..models.loading import load_draft
from ..runtime.distill.data import load_sequence_files
from ..runtime.distill.trainer import TrainConfig, expected_accepted_length, heldout_agreement
from .train_draft import plain_target

DRAFT_STEPS = 7
BATCH_SIZE = 8
MAX_LENGTH = 512


def run_agreement(args: argparse.Namespace) -> int:
    """Measure `args.draft` on `args.sequences` (the first `args.max_prompts`); print the
    per-step agreement and chain length, and write them as one JSON line to `args.json`."""
    sequences = load_sequence_files(args.sequences)[: args.max_prompts]
    if not sequences:
        raise ValueError(f"no sequences in {args.sequences}; give files train-draft wrote")
    target = plain_target(args)
    # Float32 head weights under the target's autocast, as in training.
    head = load_draft(args.draft, target=target).float()
    config = TrainConfig(batch_size=BATCH_SIZE, max_length=MAX_LENGTH, num_ttt_steps=DRAFT_STEPS)
    agreement = heldout_agreement(head, target, sequences, config=config)
    record = {
        "draft": str(args.draft),
        "sequences": [str(path) for path in args.sequences],
        "num_sequences": len(sequences),
        "agreement": agreement,
        "chain_length": expected_accepted_length(agreement),
    }
    rates = " ".join(f"{rate:.3f}" for rate in agreement)
    print(f"top-1 agreement per draft step over {len(sequences)} sequences: {rates}")
    print(f"chain length (tokens per round of a chain draft): {record['chain_length']:.3f}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0
