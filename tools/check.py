"""`specrun check`: greedy decoding with and without speculation must agree token for token.

It is how a user checks their own model, head and hardware. With the embedded model it checks
the shipped head unless `--draft` names another; the trees are the head's own table
(`default_trees`) unless `--depth/--topk/--nodes` ask for one shape. In float32 the outputs must be
identical; in bf16/fp16 a divergence can only come from a near-tie of the target's top two
logits, which the command reports as such.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..models.default import resolve_draft
from ..runtime.config import EngineConfig, SamplingParams
from ..runtime.engine import Engine
from .generate import add_tree_arguments, tree_table

DEFAULT_PROMPTS = (
    "Write a haiku about eagles.",
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="verify that speculative greedy output equals plain greedy output"
    )
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument(
        "--draft",
        default=None,
        help="EAGLE draft-head directory (default: the shipped head for the embedded model)",
    )
    parser.add_argument("--prompts", default=None, help="JSONL file of {'prompt': ...} lines")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    add_tree_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    draft = resolve_draft(args.model, args.draft)
    if draft is None:
        raise ValueError("--draft is needed with --model: pass the head directory to check")
    trees = tree_table(args, draft=draft)
    config = EngineConfig(device=args.device, dtype=args.dtype, trees=trees)
    spec = Engine.from_pretrained(args.model, draft=draft, config=config)
    plain = Engine(spec.model, spec.tokenizer, config)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    num_bad = 0
    for index, (w, g) in enumerate(zip(want, got, strict=True)):
        if w.token_ids == g.token_ids:
            continue
        num_bad += 1
        position = next(
            (i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids, strict=False)) if a != b),
            min(len(w.token_ids), len(g.token_ids)),
        )
        print(
            f"prompt {index}: outputs differ at generated token {position}: plain "
            f"{w.token_ids[position : position + 5]} vs speculative "
            f"{g.token_ids[position : position + 5]}",
            file=sys.stderr,
        )
    stats = spec.stats()
    bucket = config.bucket_for(min(len(prompts), config.buckets[-1]))
    print(
        f"{len(prompts) - num_bad}/{len(prompts)} prompts identical; mean accepted length "
        f"{stats.mean_accepted_length:.2f} tokens/round over {stats.num_rounds} rounds "
        f"(batch bucket {bucket}, tree {config.tree_for(bucket)})"
    )
    return 1 if num_bad else 0


def _read_prompts(path: str) -> list[str]:
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line must be a JSON object with a 'prompt'")
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
