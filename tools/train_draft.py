"""`specrun train-draft`: train an EAGLE draft head for a model by online self-distillation.

The target answers the prompts (greedy, sampled with --temperature, or a mix with
--response-temperatures; prompts with a follow-up turn get a second answer over the first),
then trains the head on those sequences with the target running inside the loop
(runtime/distill). The output directory is a draft head in the published layout:
`specrun generate --draft OUT`. With --generate-only it writes the sequences alone
(OUT/sequences.jsonl.gz), for training runs that reuse them (--sequences).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from ..models.config import DRAFT_KINDS
from ..models.default import default_model_dir
from ..models.llama import Llama
from ..models.loading import load_target
from ..models.tokenizer import Tokenizer
from ..runtime.config import EngineConfig
from ..runtime.distill.broad_prompts import CATEGORIES
from ..runtime.distill.checkpoint import checkpoint_heldout_path, checkpoint_sequences_path
from ..runtime.distill.data import (
    generate_record_sequences,
    load_sequence_files,
    load_sequences,
    read_prompt_records,
    save_sequences,
)
from ..runtime.distill.self_instruct import self_instruct_records
from ..runtime.distill.trainer import TrainConfig, train_draft

logger = logging.getLogger(__name__)

GENERATED_FILE = "sequences.jsonl.gz"
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train-draft", help="train a draft head by distillation")
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--out", required=True, help="output head directory")
    parser.add_argument("--kind", choices=DRAFT_KINDS, default="eagle3")
    parser.add_argument(
        "--prompts", default=None,
        help='JSONL of {"prompt": ...} lines (optionally "category", "follow_up"), or a '
        "built-in split: builtin:train, builtin:train-broad (eight categories, follow-ups)",
    )  # fmt: skip
    parser.add_argument(
        "--sequences",
        nargs="+",
        default=None,
        metavar="FILE",
        help="train on sequences an earlier run wrote (OUT/checkpoint/sequences.jsonl, may be "
        ".gz) instead of generating them",
    )
    parser.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument(
        "--self-instruct",
        type=int,
        default=0,
        metavar="N",
        help="add N prompts the model writes itself on vocabulary topics (broader data)",
    )
    parser.add_argument(
        "--self-instruct-categories", action="store_true",
        help="deal the self-instruct topics to the eight prompt categories (writing, coding, "
        "math, ...), each asked with its category's instruction",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=256, help="response length")
    parser.add_argument(
        "--temperature", type=float, default=None, help="responses: 0 = greedy (the default)"
    )
    parser.add_argument(
        "--response-temperatures", type=float, nargs="+", default=None, metavar="T",
        help="answer prompt i at the (i mod n)-th of these temperatures: 0 1 answers half the "
        "prompts greedily and half sampled, 0 0 1 a third sampled (instead of --temperature)",
    )  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--ttt-steps", type=int, default=7, help="training-time-test depth")
    parser.add_argument(
        "--draft-vocab", type=int, default=None,
        help="EAGLE-3 draft vocabulary: the N most frequent response tokens (default 32000 for "
        "a new head; with --init-from the head keeps its own unless this is given)",
    )  # fmt: skip
    parser.add_argument(
        "--num-layers", type=int, default=None,
        help="dense and eagle3 heads: attention layers (default 1, or the --init-from head's; "
        "more than that head's appends layers that start as the identity)",
    )  # fmt: skip
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument(
        "--length-groups", type=int, default=1, metavar="G",
        help="cut each run of G steps' batches from one draw of G x --batch-size sequences "
        "sorted by length, into batches of about equal response tokens: a batch pads to about "
        "its own rows' length (fewer padded tokens a step; --batch-size rows on average; 1: "
        "every batch a random draw)",
    )  # fmt: skip
    parser.add_argument("--checkpoint-interval", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--heldout", type=int, default=8, help="held-out sequences")
    parser.add_argument(
        "--heldout-sequences", nargs="+", default=None, metavar="FILE",
        help="measure the held-out agreement on the first --heldout sequences of these files "
        "(written by an earlier run) instead of the last training sequences: the same set "
        "makes runs comparable, and a fine-tune (--init-from) is measured before it starts",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    parser.add_argument(
        "--init-from", default=None, help="start from this head directory (fine-tune it)"
    )
    parser.add_argument(
        "--generate-only",
        action="store_true",
        help="write the generated sequences to OUT/sequences.jsonl.gz and stop (train on them "
        "later with --sequences)",
    )
    parser.add_argument("--stop-at", type=int, default=None, help="checkpoint and stop at step")
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="checkpoint and stop after this long"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="target dtype: auto, float32, bfloat16")
    parser.add_argument(
        "--generate-batch-size", type=int, default=64, help="prompts answered at once"
    )
    parser.add_argument(
        "--save-dtype", choices=sorted(SAVE_DTYPES), default="bfloat16", help="head weights"
    )
    parser.add_argument(
        "--max-shard-mib", type=float, default=15.0, help="split head weights into shards"
    )
    parser.set_defaults(func=run)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        kind=args.kind,
        num_steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        num_warmup_steps=args.warmup_steps,
        num_ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab if args.kind == "eagle3" else None,
        num_layers=args.num_layers,
        max_length=args.max_length,
        length_groups=args.length_groups,
        checkpoint_interval=args.checkpoint_interval,
        eval_interval=args.eval_interval,
        num_heldout=args.heldout,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    if not (args.prompts or args.sequences or args.resume):
        raise ValueError("give --prompts to generate training data, or --sequences FILE")
    if args.sequences and (args.prompts or args.resume):
        raise ValueError("--sequences replaces --prompts and --resume; give only one of them")
    if args.generate_only and not args.prompts:
        raise ValueError("--generate-only generates from --prompts; give them")
    if args.heldout_sequences and args.resume:
        raise ValueError("--resume measures the held-out set of the run it continues; "
                         "leave out --heldout-sequences")  # fmt: skip
    config = train_config(args)
    model_dir = args.model or default_model_dir()
    target = plain_target(args)
    heldout = _heldout_sequences(args)
    if args.resume:
        sequences = load_sequences(checkpoint_sequences_path(args.out))
    elif args.sequences:
        sequences = load_sequence_files(args.sequences)
    else:
        sequences = _self_distilled(args, target, model_dir)
    num_tokens = sum(len(s.token_ids) - s.num_prompt for s in sequences)
    if args.generate_only:
        path = Path(args.out) / GENERATED_FILE
        save_sequences(sequences, path)
        print(f"wrote {len(sequences)} sequences ({num_tokens} response tokens) to {path}")
        return 0
    print(
        f"training a {args.kind} head on {len(sequences)} sequences ({num_tokens} response tokens)"
    )
    result = train_draft(
        target,
        sequences,
        config=config,
        out_dir=args.out,
        resume=args.resume,
        stop_at=args.stop_at,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
        save_dtype=SAVE_DTYPES[args.save_dtype],
        max_shard_bytes=int(args.max_shard_mib * 2**20),
        init_from=args.init_from,
        heldout=heldout,
    )
    if result.losses:
        print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    reported = [e for e in result.heldout[:-1] if e[0] == 0] + result.heldout[-1:]
    for step, agreement in reported:
        rates = " ".join(f"{a:.3f}" for a in agreement)
        print(f"held-out top-1 agreement per draft step at step {step}: {rates}")
    print(f"wrote the {args.kind} head to {args.out}")
    return 0


def plain_target(args: argparse.Namespace) -> Llama:
    """The target `--model` names (default: the embedded one) on `--device` in `--dtype`,
    with its plain weights: training and teacher-forced evaluation take no engine packing."""
    config = EngineConfig(device=args.device, dtype=args.dtype)
    return load_target(
        args.model or default_model_dir(),
        dtype=config.resolved_dtype(),
        device=config.resolved_device(),
    )


def _heldout_sequences(args: argparse.Namespace) -> list | None:
    """The run's own held-out set: --heldout-sequences, or the one a resumed run kept; None
    to hold out the last training sequences."""
    if args.heldout_sequences:
        return load_sequence_files(args.heldout_sequences)
    kept = checkpoint_heldout_path(args.out)
    return load_sequences(kept) if args.resume and kept.is_file() else None


def response_temperatures(args: argparse.Namespace) -> list[float]:
    """The temperatures prompts are answered at, in turn: --response-temperatures, else
    --temperature, else greedy."""
    if args.response_temperatures is not None and args.temperature is not None:
        raise ValueError("give --temperature or --response-temperatures, not both")
    temperatures = args.response_temperatures or [args.temperature or 0.0]
    if min(temperatures) < 0:
        raise ValueError(f"response temperatures must be >= 0, got {temperatures}")
    return temperatures


def _self_distilled(args: argparse.Namespace, target, model_dir):
    temperatures = response_temperatures(args)
    records = read_prompt_records(args.prompts)[: args.max_prompts]
    tokenizer = None
    if args.self_instruct or any(isinstance(r.prompt, str) for r in records):
        tokenizer = Tokenizer.from_dir(model_dir)
    if args.self_instruct:
        print(f"writing {args.self_instruct} self-instruct prompts")
        records += self_instruct_records(
            target,
            tokenizer,
            num_prompts=args.self_instruct,
            categories=CATEGORIES if args.self_instruct_categories else None,
            seed=args.seed,
            batch_size=args.generate_batch_size,
        )
    num_follow_ups = sum(r.follow_up is not None for r in records)
    print(
        f"generating responses to {len(records)} prompts and {num_follow_ups} follow-ups "
        f"(up to {args.max_new_tokens} tokens, temperatures {temperatures})"
    )
    return generate_record_sequences(
        target,
        tokenizer,
        records,
        max_new_tokens=args.max_new_tokens,
        temperatures=temperatures,
        seed=args.seed,
        batch_size=args.generate_batch_size,
        chat_template=not args.raw,
    )
