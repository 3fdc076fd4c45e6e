"""Training checkpoints: head, optimizer and step under out/checkpoint, and where a run
keeps its training and held-out sequences so that a resumed run continues on the same data.

A saved head that is not the one the resuming options build is refused with the options to
repeat.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ...models.eagle import DraftHead

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.pt"
SEQUENCES_FILE = "sequences.jsonl"
HELDOUT_FILE = "heldout.jsonl"


def save_checkpoint(
    out_dir: Path, head: DraftHead, optimizer: torch.optim.Optimizer, step: int, config
) -> None:
    """Write head state + optimizer + step (+ the config as a dict) to out/checkpoint."""
    directory = out_dir / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "head": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "config": dataclasses.asdict(config),
    }
    tmp = directory / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(directory / STATE_FILE)
    logger.info("checkpoint at step %d in %s", step, directory)


def load_checkpoint(out_dir: Path, head: DraftHead, optimizer: torch.optim.Optimizer) -> int:
    """Restore head and optimizer from out/checkpoint; returns the saved step (a ValueError
    when the saved head is not the one these options build: `_check_saved_head`)."""
    path = out_dir / CHECKPOINT_DIR / STATE_FILE
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}; run without --resume to start afresh")
    device = next(head.parameters()).device
    state = torch.load(path, map_location=device, weights_only=True)
    _check_saved_head(path, state, head)
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _check_saved_head(path: Path, state: dict, head: DraftHead) -> None:
    """A ValueError naming the options to repeat when the saved head's tensors are not
    `head`'s: other names (--kind, --num-layers) or other shapes (--draft-vocab, most
    likely)."""
    saved, built = state["head"], head.state_dict()
    if saved.keys() != built.keys():
        kind = state["config"]["kind"]
        layers = {name.split(".")[1] for name in saved if name.startswith("layers.")}
        num_layers = len(layers) + (1 if kind == "eagle3" else 0)  # the mid layer
        raise ValueError(
            f"{path} holds a {kind} head of {num_layers} layers, not the head these options "
            f"build; resume with those of the run that wrote it (--kind {kind} "
            f"--num-layers {num_layers})"
        )
    mismatched = [
        f"{name} {list(saved[name].shape)} (these options: {list(tensor.shape)})"
        for name, tensor in built.items()
        if tensor.shape != saved[name].shape
    ]
    if mismatched:
        raise ValueError(
            f"{path} holds a head of other shapes: {'; '.join(mismatched)}; resume with the "
            "options of the run that wrote it (--draft-vocab sizes an EAGLE-3 head's lm_head)"
        )


def checkpoint_sequences_path(out_dir: str | Path) -> Path:
    """Where a run keeps its training sequences (so a resumed run trains on the same data)."""
    return Path(out_dir) / CHECKPOINT_DIR / SEQUENCES_FILE


def checkpoint_heldout_path(out_dir: str | Path) -> Path:
    """Where a run given a held-out set keeps it (a resumed run measures the same one)."""
    return Path(out_dir) / CHECKPOINT_DIR / HELDOUT_FILE
