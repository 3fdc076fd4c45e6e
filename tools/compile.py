"""`specrun compile`: compile every step ahead of time and write an artifact directory.

For every bucket (and its draft tree) the prefill forwards and both sampling variants of the
round are compiled as the engine compiles them (Inductor with specrun's passes), through
Dynamo's precompile, and on CUDA the rounds are captured too. The compile caches, the
precompiled graphs and a manifest (torch / triton / Python versions, GPU and
compute capability, dtype, model and head config hashes, buckets, trees, KV capacity, source
hash, file checksums) land in `--out`, which `Engine.from_pretrained(..., artifacts=OUT)`
then loads without compiling. See runtime/graphs/artifacts.py for what each file holds.

Idempotent: if `--out` already holds intact artifacts for the same inputs, nothing is done
(`--force` rebuilds); otherwise the new directory is built beside it and swapped in complete.

`--only-buckets` builds a part: the graphs of some of `--buckets`, for the same engine. Parts
written as subdirectories of one directory (`--out DIR/part-1`, `--out DIR/part-2` ...), by
separate processes or machines with the same GPU, load together: `artifacts=DIR`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from ..models.default import default_model_dir
from ..models.loading import load_draft, load_target
from ..runtime import aot
from ..runtime.config import DEFAULT_BUCKETS, DEFAULT_TREES, EngineConfig
from ..runtime.decoder import Decoder
from ..runtime.tree import TreeShape


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compile", help="compile every bucket's steps ahead of time into an artifact directory"
    )
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument("--draft", default=None, help="EAGLE draft-head directory")
    parser.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    parser.add_argument(
        "--tree", type=int, nargs=3, default=None, metavar=("D", "K", "N"),
        help="one draft tree for every bucket (default: the engine's per-bucket table)",
    )  # fmt: skip
    parser.add_argument("--max-seq-len", type=int, default=EngineConfig.max_seq_len)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="for engines run with cuda_graphs=False"
    )
    parser.add_argument(
        "--skip-filtered",
        action="store_true",
        help="leave out the top-k/top-p round variants (compiled on first use instead)",
    )
    parser.add_argument(
        "--no-precompile",
        action="store_true",
        help="compile caches only: loading skips Inductor and Triton but Dynamo still traces",
    )
    parser.add_argument(
        "--only-buckets", type=int, nargs="+", default=None, metavar="B",
        help="build only these of --buckets (one part of a build; see above)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.set_defaults(func=run)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the artifacts are for (the engine must be built with the same)."""
    trees = {1: TreeShape(*args.tree)} if args.tree else DEFAULT_TREES
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        buckets=tuple(args.buckets),
        trees=trees,
        max_seq_len=args.max_seq_len,
        compile=True,
        cuda_graphs=False if args.no_cuda_graphs else None,
    )


def run(args: argparse.Namespace) -> int:
    config = engine_config(args)
    model_dir = args.model or default_model_dir()
    started = time.perf_counter()
    # As Engine.from_pretrained loads them: the artifacts' model hash must match the engine's.
    target = load_target(model_dir, dtype=config.resolved_dtype(), device=config.resolved_device())
    head = load_draft(args.draft, target=target) if args.draft else None
    decoder = Decoder(target, head, config)
    filtered, precompile = not args.skip_filtered, not args.no_precompile
    if not args.force and aot.is_up_to_date(
        decoder, args.out, filtered=filtered, precompile=precompile, buckets=args.only_buckets
    ):
        print(f"{args.out} is up to date for these inputs (--force rebuilds)")
        return 0
    loaded = time.perf_counter()
    manifest = aot.build(
        decoder,
        args.out,
        filtered=filtered,
        precompile=precompile,
        progress=True,
        command=shlex.join(["specrun", *sys.argv[1:]]),
        buckets=args.only_buckets,
    )
    seconds = time.perf_counter() - loaded
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(
        f"wrote {args.out}: {len(manifest.files)} files, {size / 2**20:.1f} MiB, "
        f"buckets {list(manifest.built)} of {list(manifest.buckets)}, "
        f"{len(manifest.precompiled)} precompiled graphs, "
        f"for {manifest.device} ({manifest.capability}), torch {manifest.torch}; "
        f"loaded in {loaded - started:.1f} s, compiled in {seconds:.1f} s"
    )
    decoder.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return 0
