"""`specrun check`: greedy decoding with and without speculation must agree token for token.

It is how a user checks their own model, head and hardware. In float32 the outputs must be
identical; in bf16/fp16 a divergence can only come from a near-tie of the target's top two
logits, which the command reports as such.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..runtime.config import EngineConfig, SamplingParams
from ..runtime.engine import Engine
from .generate import add_tree_arguments, tree_shape

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
    parser.add_argument("--draft", required=True, help="EAGLE draft-head directory")
    parser.add_argument("--prompts", default=None, help="JSONL file of {'prompt': ...} lines")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    add_tree_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args.prompts) if args.prompts else list(DEFAULT_PROMPTS)
    config = EngineConfig(device=args.device, dtype=args.dtype, trees={1: tree_shape(args)})
    spec = Engine.from_pretrained(args.model, draft=args.draft, config=config)
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
    print(
        f"{len(prompts) - num_bad}/{len(prompts)} prompts identical; mean accepted length "
        f"{stats.mean_accepted_length:.2f} tokens/round over {stats.num_rounds} rounds"
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
