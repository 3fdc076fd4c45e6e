"""`specrun init-draft`: write a randomly initialised draft head for a model.

A starting point for training, and the cheapest way to check a setup end to end:
`specrun check` must pass with any head, since speculation never changes greedy output.
"""

from __future__ import annotations

import argparse

import torch

from ..models.config import DRAFT_KINDS, DraftConfig
from ..models.default import default_model_dir
from ..models.eagle import build_draft
from ..models.loading import load_target, save_draft


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("init-draft", help="write a random-weight draft head")
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--kind", choices=DRAFT_KINDS, default="eagle3")
    parser.add_argument(
        "--num-layers", type=int, default=1, help="dense and eagle3 heads: attention layers"
    )
    parser.add_argument("--draft-vocab", type=int, default=None, help="EAGLE-3 draft vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model_dir = args.model or default_model_dir()
    target = load_target(model_dir, dtype=torch.float32, device="cpu")
    config = DraftConfig(
        kind=args.kind,
        layer=target.config,
        num_layers=1 if args.kind == "eagle1" else args.num_layers,
        draft_vocab_size=args.draft_vocab if args.kind == "eagle3" else None,
        tap_layers=target.tap_layers if args.kind == "eagle3" else None,
    )
    torch.manual_seed(args.seed)
    head = build_draft(config, target)
    out = save_draft(head, args.out)
    print(f"wrote a random {args.kind} head for {model_dir} to {out}")
    return 0
