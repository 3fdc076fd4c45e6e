"""`specrun generate`: run one prompt, stream the answer, report tokens/s."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from ..models.default import resolve_draft
from ..runtime.config import (
    DEFAULT_TREE,
    POLICY_NAMES,
    EngineConfig,
    SamplingParams,
    default_trees,
    stochastic_trees,
)
from ..runtime.engine import Engine
from ..runtime.tree import StaticTree, TreeShape


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text for a prompt (default model: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    add_model_arguments(parser)
    add_tree_arguments(parser)
    add_policy_argument(parser)
    add_compile_argument(parser)
    add_tensor_parallel_argument(parser)
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
    draft = draft_dir(args)
    trees = tree_table(args, draft=draft)
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        chat_template=not args.raw,
        trees=trees,
        policy=args.policy,
        compile=compile_choice(args),
        tensor_parallel=args.tp,
    )
    engine = Engine.from_pretrained(args.model, draft=draft, config=config)
    if engine is None:
        return 0  # a rank other than 0 under torchrun: rank 0 has generated and closed
    for delta in engine.stream(args.prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    engine.wait_idle()
    stats = engine.stats()
    accepted = ""
    if engine.head is not None:
        accepted = f", {stats.mean_accepted_length:.2f} tokens/round over {stats.num_rounds} rounds"
    print(
        f"[{stats.num_generated_tokens} tokens in {stats.decode_seconds:.2f} s: "
        f"{stats.tokens_per_second:.1f} tok/s{accepted}]",
        file=sys.stderr,
    )
    engine.close()
    return 0


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --draft and --no-draft (read back by `draft_dir`)."""
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument(
        "--draft",
        default=None,
        help="EAGLE draft-head directory (default: the shipped head for the embedded model)",
    )
    parser.add_argument("--no-draft", action="store_true", help="decode without speculation")


def draft_dir(args: argparse.Namespace) -> str | Path | None:
    """--draft, else the shipped head when the model is the embedded default; --no-draft:
    none."""
    if args.no_draft and args.draft is not None:
        raise ValueError("--draft and --no-draft contradict each other; pass one")
    return resolve_draft(args.model, False if args.no_draft else args.draft)


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """--no-compile (read back by `compile_choice`)."""
    parser.add_argument(
        "--no-compile", action="store_true",
        help="run the rounds eagerly instead of compiling them with Inductor (on CUDA still "
        "captured in CUDA graphs): starts in seconds instead of minutes, decodes slower",
    )  # fmt: skip


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """--tp: EngineConfig.tensor_parallel."""
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="split the model over N ranks, one process and one GPU each (cuda:0..N-1; its "
        "heads, KV heads, MLP width and vocabulary must divide by N); the other ranks are "
        "started here, or, under `torchrun --nproc-per-node N`, join this one",
    )  # fmt: skip


def compile_choice(args: argparse.Namespace) -> bool | None:
    """EngineConfig.compile for --no-compile: off, else the device's default."""
    return False if args.no_compile else None


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """--depth/--topk/--nodes: one draft-tree shape (D, K, N) for every batch size; unset
    ones take the batch-1 default, and with none given each bucket uses its default tree."""
    parser.add_argument("--depth", type=int, default=None, help="tree depth D")
    parser.add_argument("--topk", type=int, default=None, help="frontier width K")
    parser.add_argument("--nodes", type=int, default=None, help="tree nodes N (root included)")
    parser.add_argument(
        "--stochastic",
        action="store_true",
        help="sampling requests draft by sampling from the head, verified by rejection sampling",
    )


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    """--policy: how each round's tree is chosen (EngineConfig.policy)."""
    parser.add_argument(
        "--policy",
        default="cost",
        choices=POLICY_NAMES,
        help="how each round picks its tree among the bucket's tree, smaller ones and plain "
        "decoding: cost (expected tokens per measured second; default), fixed (the tree "
        "only), batch-table, ema, gammatune, dsde",
    )


def tree_shape(args: argparse.Namespace) -> TreeShape:
    """The tree the arguments ask for (the batch-1 default where unset)."""
    return TreeShape(
        depth=DEFAULT_TREE.depth if args.depth is None else args.depth,
        topk=DEFAULT_TREE.topk if args.topk is None else args.topk,
        num_nodes=DEFAULT_TREE.num_nodes if args.nodes is None else args.nodes,
        stochastic=args.stochastic,
    )


def tree_table(
    args: argparse.Namespace, *, draft: str | Path | None = None
) -> Mapping[int, TreeShape | StaticTree | None]:
    """EngineConfig.trees: the asked-for tree at every bucket, else the default table with the
    draft head's recommended trees over it (`default_trees`)."""
    if args.depth is None and args.topk is None and args.nodes is None:
        trees = default_trees(draft)
        return stochastic_trees(trees) if args.stochastic else trees
    return {1: tree_shape(args)}
