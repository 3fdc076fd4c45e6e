"""`specrun generate`: run one prompt, stream the answer, report tokens/s."""

from __future__ import annotations

import argparse
import sys

from ..runtime.config import EngineConfig, SamplingParams
from ..runtime.engine import Engine


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text for a prompt (default model: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    config = EngineConfig(device=args.device, dtype=args.dtype, chat_template=not args.raw)
    engine = Engine.from_pretrained(args.model, config=config)
    for delta in engine.stream(args.prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    stats = engine.stats()
    print(
        f"[{stats.num_generated_tokens} tokens in {stats.decode_seconds:.2f} s: "
        f"{stats.tokens_per_second:.1f} tok/s]",
        file=sys.stderr,
    )
    engine.close()
    return 0
