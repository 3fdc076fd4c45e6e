"""`specrun serve`: the OpenAI-compatible HTTP server (server/app.py) on uvicorn.

Defaults: the embedded SmolLM2-135M-Instruct with its shipped head, on the GPU when there is
one, on 127.0.0.1:8000. On CUDA every bucket's rounds are compiled and captured before the
server accepts requests (or loaded from `--artifacts`, the output of `specrun compile` for the
same options), so no request waits for a compilation; `--no-compile` captures eager rounds
instead (a warm-up of seconds per round, slower rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from ..runtime.async_engine import AsyncEngine
from ..runtime.config import DEFAULT_BUCKETS, EngineConfig, stochastic_trees
from ..runtime.engine import Engine
from ..runtime.tree import TreeShape
from .compile import tree_option_table
from .eval import parse_tree_shape
from .generate import (
    add_compile_argument,
    add_model_arguments,
    add_policy_argument,
    add_tensor_parallel_argument,
    compile_choice,
    draft_dir,
)

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
RANDOM_8B_NAME = "random-llama-3.1-8b-shapes"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI completions and chat API over HTTP (default model: "
        "SmolLM2-135M-Instruct with its shipped head)",
    )  # fmt: skip
    add_model_arguments(parser)
    parser.add_argument(
        "--random-8b", action="store_true",
        help="for benchmarks: Llama-3.1-8B shapes with random weights and a random EAGLE-3 "
        "head (no --no-draft), with the embedded model's tokenizer and so its 49152-token "
        "vocabulary (or --tokenizer's); the text is noise, the timing is real",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", type=Path, default=None,
        help="with --random-8b: a directory with tokenizer.json (default: the embedded model's)",
    )  # fmt: skip
    parser.add_argument(
        "--artifacts", type=Path, default=None,
        help="start from `specrun compile` output built for the same options",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    parser.add_argument(
        "--tree", type=int, nargs=3, default=None, metavar=("D", "K", "N"),
        help="one draft tree for every bucket (default: the per-bucket table with the head's "
        "trees.json over it)",
    )  # fmt: skip
    parser.add_argument(
        "--tree-at", type=_bucket_tree, action="append", default=[], metavar="BUCKET=D,K,N",
        help="the tree of the buckets from BUCKET up (repeatable; BUCKET=none: plain "
        "decoding there), replacing those of --tree or the default table",
    )  # fmt: skip
    parser.add_argument("--stochastic", action="store_true", help="stochastic trees")
    parser.add_argument("--max-seq-len", type=int, default=EngineConfig.max_seq_len)
    parser.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting)
    parser.add_argument("--max-prefill-tokens", type=int, default=EngineConfig.max_prefill_tokens)
    parser.add_argument(
        "--static-batches", action="store_true",
        help="admit requests only when none decodes (static batching, for comparison)",
    )  # fmt: skip
    add_policy_argument(parser)
    add_compile_argument(parser)
    add_tensor_parallel_argument(parser)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument(
        "--no-warmup", action="store_true", help="prepare graphs on first use instead"
    )
    parser.add_argument(
        "--skip-filtered", action="store_true",
        help="leave the top-k/top-p round variants out of the warm-up (compiled when a "
        "request first needs one, stalling the others meanwhile)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-prompt-tokens", type=int, default=512, metavar="TOKENS",
        help="capture the prefill graphs of prompts up to this long during the warm-up "
        "(longer ones are captured on first use)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def _bucket_tree(text: str) -> tuple[int, TreeShape | None]:
    """'BUCKET=D,K,N' or 'BUCKET=none' -> (bucket, tree or None)."""
    bucket, _, shape = text.partition("=")
    if not bucket.strip().isdigit() or not shape:
        raise argparse.ArgumentTypeError(f"expected BUCKET=D,K,N or BUCKET=none, not {text!r}")
    return int(bucket), None if shape.strip().lower() == "none" else parse_tree_shape(shape)


def engine_config(args: argparse.Namespace, draft: str | Path | None) -> EngineConfig:
    given = {bucket: tree for bucket, tree in args.tree_at}
    if args.stochastic:
        given = stochastic_trees(given)
    trees = tree_option_table(args, draft)
    trees = {k: tree for k, tree in trees.items() if not any(g < k for g in given)} | given
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        buckets=tuple(args.buckets),
        trees=trees,
        max_seq_len=args.max_seq_len,
        max_waiting=args.max_waiting,
        max_prefill_tokens=args.max_prefill_tokens,
        continuous_batching=not args.static_batches,
        policy=args.policy,
        compile=compile_choice(args),
        tensor_parallel=args.tp,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server import build_app

    if args.random_8b and (args.model or args.draft or args.artifacts):
        raise ValueError("--random-8b builds its own model; drop --model, --draft, --artifacts")
    if args.random_8b and args.tp > 1:
        raise ValueError("--random-8b runs in one process; drop --tp or serve a model directory")
    if args.tokenizer and not args.random_8b:
        raise ValueError("--tokenizer goes with --random-8b (a model directory has its own)")
    draft = None if args.random_8b else draft_dir(args)
    config = engine_config(args, draft)
    if args.random_8b:
        engine = AsyncEngine(
            random_8b_engine(config, plain=args.no_draft, tokenizer_dir=args.tokenizer)
        )
    else:
        engine = AsyncEngine.from_pretrained(
            args.model, draft=draft or False, config=config, artifacts=args.artifacts
        )
        if engine is None:
            return 0  # a rank other than 0 under torchrun: rank 0 served and closed
    if not args.no_warmup and config.resolved_device().type == "cuda":
        engine.engine.warmup(
            filtered=not args.skip_filtered,
            progress=True,
            prompt_lengths=range(1, args.warmup_prompt_tokens + 1),
        )
    name = args.served_model_name or (
        Path(args.model).name if args.model else RANDOM_8B_NAME if args.random_8b
        else EMBEDDED_MODEL_NAME
    )  # fmt: skip
    app = build_app(engine, model_name=name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
    return 0


def random_8b_engine(
    config: EngineConfig, *, plain: bool, tokenizer_dir: Path | None = None
) -> Engine:
    """An Engine over Llama-3.1-8B shapes with random weights (and, unless `plain`, a random
    EAGLE-3 head with a 32000-token draft vocabulary), tokenizing with the tokenizer of
    `tokenizer_dir` (default: the embedded model's). The vocabulary is that tokenizer's: with
    the embedded one the LM head is [49152, 4096] instead of [128256, 4096] (0.40 of 16 GB of
    weights instead of 1.05)."""
    from ..models.default import default_model_dir
    from ..models.tokenizer import Tokenizer
    from .random_models import LLAMA_31_8B, random_eagle3_head, random_target

    tokenizer = Tokenizer.from_dir(tokenizer_dir or default_model_dir())
    shapes = dataclasses.replace(LLAMA_31_8B, vocab_size=tokenizer.vocab_size)
    dtype = config.resolved_dtype()
    target = random_target(shapes, device=str(config.resolved_device()), dtype=dtype)
    head = None if plain else random_eagle3_head(target, draft_vocab_size=32000, dtype=dtype)
    return Engine(target, tokenizer, config, head=head)
