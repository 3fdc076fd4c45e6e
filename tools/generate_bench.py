"""`specrun bench generate`: what `specrun generate` gives a user, per speculation policy and
without a draft: the first built-in held-out prompts decoded one at a time (as the command
does), output tokens per wall second, tokens per round and the shapes the rounds ran.

One engine per setting, warmed up by one untimed request; the policy learns its costs and
acceptance across the prompts, as a long-running engine would.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ..models.default import resolve_draft
from ..runtime.config import EngineConfig, SamplingParams, default_trees
from ..runtime.distill.prompts import builtin_prompts
from ..runtime.engine import Engine

logger = logging.getLogger(__name__)
NO_DRAFT = "no-draft"


def register(subjects: argparse._SubParsersAction) -> None:
    parser = subjects.add_parser(
        "generate", help="`specrun generate` per speculation policy and without a draft"
    )
    parser.add_argument(
        "--settings", nargs="+", default=["cost", "fixed", NO_DRAFT],
        help=f"policy names (EngineConfig.policy) and {NO_DRAFT!r}",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--json", default=None, help="append one JSON line per setting here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompts = builtin_prompts("heldout", num_prompts=args.num_prompts)
    params = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0
    )
    rows = [measure(args, setting, prompts, params) for setting in args.settings]
    if args.json:
        with open(args.json, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


def measure(
    args: argparse.Namespace, setting: str, prompts: list[str], params: SamplingParams
) -> dict:
    """Decode `prompts` one at a time with one engine of the setting; its numbers."""
    draft = resolve_draft(args.model, False if setting == NO_DRAFT else None)
    policy = "fixed" if setting == NO_DRAFT else setting
    # The trees `specrun generate` uses: the head's own table over the default one.
    config = EngineConfig(
        device=args.device, dtype=args.dtype, policy=policy, trees=default_trees(draft)
    )
    engine = Engine.from_pretrained(args.model, draft=draft or False, config=config)
    engine.generate("Say hello.", SamplingParams(max_new_tokens=8))
    num_tokens, num_rounds, seconds = 0, 0, 0.0
    for prompt in prompts:
        started = time.perf_counter()
        (out,) = engine.generate(prompt, params)
        seconds += time.perf_counter() - started
        num_tokens += len(out.token_ids)
        num_rounds += out.stats.num_rounds
    engine.wait_idle()
    shapes = engine.stats().rounds_by_shape
    device = str(engine.decoder.device)
    engine.close()
    row = {
        "setting": setting,
        "device": device,
        "dtype": str(engine.config.resolved_dtype()).removeprefix("torch."),
        "num_prompts": len(prompts),
        "tokens": num_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(num_tokens / seconds, 2),
        "tokens_per_round": round(num_tokens / max(num_rounds, 1), 2),
        "rounds_by_shape": shapes,
        "command": "specrun " + " ".join(sys.argv[1:]),
    }
    logger.info("%s", row)
    return row


def table(rows: list[dict]) -> str:
    """A Markdown table of the settings, with each one's speed relative to no-draft."""
    base = next((r["tokens_per_second"] for r in rows if r["setting"] == NO_DRAFT), None)
    lines = [
        "| setting | tok/s | vs no-draft | tokens/round | rounds by shape |",
        "|:--|--:|--:|--:|:--|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_second'] / base:.2f}x" if base else ""
        shapes = ", ".join(f"{k} {v}" for k, v in sorted(r["rounds_by_shape"].items()))
        lines.append(
            f"| {r['setting']} | {r['tokens_per_second']:.1f} | {ratio} | "
            f"{r['tokens_per_round']:.2f} | {shapes} |"
        )
    return "\n".join(lines)
