"""`specrun compile`: compile every step ahead of time and write an artifact directory.

For every bucket (and its draft tree) the prefill forwards and the round variants
(`RoundVariant`: greedy and sampled rounds of a stochastic tree, top-k/top-p unless
`--skip-filtered`) are compiled as the engine compiles them (Inductor with specrun's
passes), through Dynamo's precompile, and on CUDA the rounds are captured too. The
compile caches, the precompiled graphs and a manifest (torch / triton / Python versions, GPU
and compute capability, dtype, model and head config hashes, buckets, trees, KV capacity, source
hash, file checksums) land in `--out`, which `Engine.from_pretrained(..., artifacts=OUT)`
then loads without compiling. See runtime/graphs/artifacts.py for what each file holds.

Idempotent: if `--out` already holds intact artifacts for the same inputs, nothing is done
(`--force` rebuilds); otherwise the new directory is built beside it and swapped in complete.

`--only-buckets` builds a part: the graphs of some of `--buckets`, for the same engine. Parts
written as subdirectories of one directory (`--out DIR/part-1`, `--out DIR/part-2` ...), by
separate processes or machines with the same GPU, load together: `artifacts=DIR`.
`--jobs N` does that itself: N processes at once, each building a share of the buckets into
`OUT/part-...` (each loads its own copy of the model and KV cache: N times the memory).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.default import default_model_dir
from ..runtime import aot, cost_profile
from ..runtime.config import DEFAULT_BUCKETS, EngineConfig, default_trees, stochastic_trees
from ..runtime.decoder import Decoder
from ..runtime.engine import load_models
from ..runtime.graphs import artifacts
from ..runtime.tree import StaticTree, TreeShape
from .generate import add_model_arguments, add_policy_argument, draft_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compile", help="compile every bucket's steps ahead of time into an artifact directory"
    )
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    parser.add_argument(
        "--tree", type=int, nargs=3, default=None, metavar=("D", "K", "N"),
        help="one draft tree for every bucket (default: the engine's per-bucket table, with the "
        "head's trees.json over it)",
    )  # fmt: skip
    parser.add_argument(
        "--stochastic", action="store_true",
        help="make the trees stochastic (sampled drafts for requests that sample)",
    )  # fmt: skip
    parser.add_argument("--max-seq-len", type=int, default=EngineConfig.max_seq_len)
    add_policy_argument(parser)
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
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="build in this many processes at once, one part each (N x the memory)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.set_defaults(func=run)


def tree_option_table(
    args: argparse.Namespace, draft: str | Path | None
) -> Mapping[int, TreeShape | StaticTree | None]:
    """EngineConfig.trees from `--tree D K N` (one tree everywhere) or the default table
    with the draft head's trees over it, stochastic with `--stochastic`."""
    trees = {1: TreeShape(*args.tree)} if args.tree else default_trees(draft)
    return stochastic_trees(trees) if args.stochastic else trees


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the artifacts are for (the engine must be built with the same)."""
    trees = tree_option_table(args, args.draft)
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        buckets=tuple(args.buckets),
        trees=trees,
        max_seq_len=args.max_seq_len,
        compile=True,
        cuda_graphs=False if args.no_cuda_graphs else None,
        policy=args.policy,
    )


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, not {args.jobs}")
    if args.jobs > 1 and args.only_buckets is not None:
        raise ValueError("--jobs builds the parts itself: leave out --only-buckets")
    args.draft = draft_dir(args)  # resolved once: everything below reads args.draft
    config = engine_config(args)
    model_dir = args.model or default_model_dir()
    started = time.perf_counter()
    # As Engine.from_pretrained loads them: the artifacts' model hash must match the engine's.
    target, head = load_models(model_dir, args.draft or None, config)
    decoder = Decoder(target, head, config)
    filtered, precompile = not args.skip_filtered, not args.no_precompile
    if not args.force and aot.is_up_to_date(
        decoder, args.out, filtered=filtered, precompile=precompile, buckets=args.only_buckets
    ):
        print(f"{args.out} is up to date for these inputs (--force rebuilds)")
        return 0
    if args.jobs > 1:
        parts = aot.split_buckets(config.buckets, args.jobs)
        decoder.close()
        del decoder, target, head  # the jobs load their own copies
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return _build_in_parts(args, parts)
    loaded = time.perf_counter()
    command = shlex.join(["specrun", *sys.argv[1:]])
    manifest = aot.build(
        decoder,
        args.out,
        filtered=filtered,
        precompile=precompile,
        progress=True,
        command=command,
        buckets=args.only_buckets,
    )
    if decoder.planner.policy.adaptive:  # what the cost policy starts from when served
        cost_profile.save_to_artifacts(
            decoder, args.out, filtered=filtered, buckets=args.only_buckets, command=command
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


def _build_in_parts(args: argparse.Namespace, parts: list[tuple[int, ...]]) -> int:
    """Run one `specrun compile --only-buckets` process per part at once, into a staging
    directory that replaces `--out` once every part is built."""
    started = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
    jobs = []
    try:
        for part in parts:
            name = "part-" + "-".join(map(str, part))
            log = open(staging / f"{name}.log", "w+")  # noqa: SIM115
            command = [*_job_command(args), "--only-buckets", *map(str, part)]
            command += ["--out", str(staging / name)]
            jobs.append((part, log, subprocess.Popen(command, stdout=log, stderr=log)))
        print(f"building buckets {[list(p) for p in parts]} in {len(parts)} processes")
        _wait_with_progress([job for _, _, job in jobs])
        failed = [(part, log) for part, log, job in jobs if job.returncode != 0]
        for part, log in failed:
            log.seek(0)
            tail = "".join(log.readlines()[-15:])
            print(f"the job for buckets {list(part)} failed:\n{tail}", file=sys.stderr)
        if failed:
            return 1
        for _, log, _ in jobs:
            log.close()
            Path(log.name).unlink()
        artifacts.replace_dir(staging, args.out)
    finally:
        for _, log, job in jobs:
            if job.poll() is None:
                job.kill()
            log.close()
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"wrote {args.out}: {len(parts)} parts, buckets {sorted(b for p in parts for b in p)}, "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return 0


def _wait_with_progress(jobs: list[subprocess.Popen]) -> None:
    """Wait for every job, with a progress bar of the parts done."""
    with tqdm(total=len(jobs), desc="parts", unit="part") as bar:
        while bar.n < len(jobs):
            time.sleep(1.0)
            bar.update(sum(job.poll() is not None for job in jobs) - bar.n)


def _job_command(args: argparse.Namespace) -> list[str]:
    """`specrun compile` with this invocation's model and engine options (no --out, --jobs)."""
    command = [sys.executable, "-m", "specrun.tools.cli", "compile", "--force"]
    if args.model:
        command += ["--model", str(args.model)]
    command += ["--draft", str(args.draft)] if args.draft else ["--no-draft"]
    command += ["--buckets", *map(str, args.buckets), "--max-seq-len", str(args.max_seq_len)]
    command += ["--device", args.device, "--dtype", args.dtype]
    if args.tree:
        command += ["--tree", *map(str, args.tree)]
    flags = {"--stochastic": args.stochastic, "--no-cuda-graphs": args.no_cuda_graphs}
    flags["--skip-filtered"] = args.skip_filtered
    flags["--no-precompile"] = args.no_precompile
    return command + [flag for flag, on in flags.items() if on]
