"""`specrun tune`: measure what every round costs on this device and save the profile where
engines find it (runtime/cost_profile.py), so the `cost` policy starts from measured costs
instead of measuring each shape as it first runs.

Prints, per bucket, each shape's milliseconds and its break-even accepted length: the draft
tokens a request must accept per round for the shape to match plain decoding
(cost / plain cost - 1).

`--stochastic` measures the default trees' stochastic forms (the sampled rounds of every
bucket) and `--trees` also each given shape fixed in every bucket, so that the profile
covers what `specrun eval --stochastic --default-trees --trees ...` runs and can be
replayed there (`eval --cost-profile`).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

from ..models.default import cache_root
from ..runtime import cost_profile
from ..runtime.config import DEFAULT_BUCKETS, EngineConfig, default_trees, stochastic_trees
from ..runtime.engine import Engine
from ..runtime.round_plan import tree_label
from ..runtime.tree import TreeShape
from .eval import parse_tree_shape
from .generate import add_compile_argument, add_model_arguments, compile_choice, draft_dir
from .serve import random_8b_engine


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune", help="measure every round's cost on this device for the cost policy"
    )
    add_model_arguments(parser)
    add_compile_argument(parser)
    parser.add_argument(
        "--random-8b", action="store_true",
        help="Llama-3.1-8B shapes with random weights and a random EAGLE-3 head, as `specrun "
        "serve --random-8b` runs them (the default trees)",
    )  # fmt: skip
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    parser.add_argument("--max-seq-len", type=int, default=EngineConfig.max_seq_len)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per shape")
    parser.add_argument("--filtered", action="store_true", help="also the top-k/top-p rounds")
    parser.add_argument(
        "--stochastic", action="store_true",
        help="the default trees' stochastic forms (their sampled rounds), as `eval "
        "--stochastic --default-trees` runs them",
    )  # fmt: skip
    parser.add_argument(
        "--trees", type=parse_tree_shape, nargs="+", default=[], metavar="D,K,N",
        help="also each of these shapes alone in every bucket, as `eval --trees` runs them",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None,
        help="write the profile here (default: the cache, where engines look for it)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.random_8b and (args.model or args.draft):
        raise ValueError("--random-8b builds its own model and head; drop --model/--draft")
    if args.trees and args.no_draft:
        raise ValueError("--trees needs a draft head; drop --no-draft")
    draft = None if args.random_8b else draft_dir(args)
    trees = default_trees(draft)
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        buckets=tuple(args.buckets),
        trees=stochastic_trees(trees) if args.stochastic else trees,
        max_seq_len=args.max_seq_len,
        compile=compile_choice(args),
    )
    if args.random_8b:
        engine = random_8b_engine(config, plain=args.no_draft)
    else:
        engine = Engine.from_pretrained(args.model, draft=draft or False, config=config)
    profile = cost_profile.measure(
        engine.decoder, num_rounds=args.rounds, filtered=args.filtered, command=command(args)
    )
    out = args.out or cost_profile.profile_path(engine.decoder, cache_root())
    modules = engine.model, engine.tokenizer, engine.head
    engine.close()
    for shape in args.trees:
        fixed = _measure_fixed(modules, config, shape, args)
        for bucket, rounds in fixed.milliseconds.items():
            for tag, ms in rounds.items():
                profile.milliseconds[bucket].setdefault(tag, ms)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_json())
    print(table(profile))
    print(f"wrote {out}")
    return 0


def _measure_fixed(
    modules: tuple, config: EngineConfig, shape: TreeShape, args: argparse.Namespace
) -> cost_profile.CostProfile:
    """The rounds of `shape` (stochastic with --stochastic) run fixed in every bucket, on an
    engine over `modules` (the model, tokenizer and head of the tuned engine)."""
    model, tokenizer, head = modules
    shape = dataclasses.replace(shape, stochastic=args.stochastic)
    fixed_config = dataclasses.replace(config, trees={1: shape}, policy="fixed")
    fixed = Engine(model, tokenizer, fixed_config, head=head)
    try:
        return cost_profile.measure(fixed.decoder, num_rounds=args.rounds, filtered=args.filtered)
    finally:
        fixed.close()


def command(args: argparse.Namespace) -> str:
    """The command line that measures this profile again."""
    words = ["specrun", "tune"]
    words += ["--model", str(args.model)] if args.model else []
    words += ["--draft", str(args.draft)] if args.draft else []
    words += ["--no-draft"] if args.no_draft else []
    words += ["--random-8b"] if args.random_8b else []
    words += ["--no-compile"] if args.no_compile else []
    words += ["--buckets", *map(str, args.buckets), "--max-seq-len", str(args.max_seq_len)]
    words += ["--device", args.device, "--dtype", args.dtype, "--rounds", str(args.rounds)]
    words += ["--filtered"] if args.filtered else []
    words += ["--stochastic"] if args.stochastic else []
    if args.trees:
        words += ["--trees", *map(tree_label, args.trees)]
    return shlex.join(words)


def table(profile: cost_profile.CostProfile) -> str:
    """Markdown: per bucket and round, milliseconds and the break-even accepted length."""
    lines = ["| bucket | round | ms | break-even accepted |", "|--:|:--|--:|--:|"]
    for bucket, rounds in sorted(profile.milliseconds.items()):
        plain = rounds.get("plain")
        for tag, ms in sorted(rounds.items(), key=lambda item: item[1]):
            even = "" if plain is None or tag.startswith("plain") else f"{ms / plain - 1:.2f}"
            lines.append(f"| {bucket} | {tag} | {ms:.3f} | {even} |")
    return "\n".join(lines)
