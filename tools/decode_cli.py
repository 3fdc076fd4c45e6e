"""`specrun bench decode`: its options, its ranks and its tables (the measurements are
tools/decode_bench.py's).

One process times every point with the whole model; with `--tp N` this process is rank 0 of
N (runtime/ranks.py), each rank builds its own random shard from the same seed and runs the
same points, and rank 0 prints. Each point is one JSON line (with where it ran); then a table
per bucket (plain step against the floor, the speculative round against the plain step), a
table of the floor's terms and the collectives' share of each round, and per point the
kernels a round launches.

`python -m specrun.tools.decode_cli FILE.jsonl ...` prints the tables again from the JSON
lines of earlier runs (`--json`), one set per model, split and execution mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from ..models.config import LlamaConfig
from ..runtime.config import DEFAULT_BUCKETS, DEFAULT_TREES, EngineConfig, stochastic_trees
from ..runtime.tree import TreeShape
from .bench_env import environment, fmt
from .random_models import SHAPES
from .round_timing import attention_segments

EXECUTION = {
    "compiled": "rounds compiled with Inductor and specrun's passes, replayed as CUDA graphs",
    "eager": "rounds run eagerly (--no-compile), replayed as CUDA graphs",
}


def register(subjects: argparse._SubParsersAction) -> None:
    """The `bench decode` sub-command and its options."""
    decode = subjects.add_parser(
        "decode", help="plain and speculative round latency per bucket (random weights)"
    )
    decode.add_argument(
        "--shapes", default="llama-3.1-8b", choices=sorted(SHAPES),
        help="the target's shapes (and its head's draft vocabulary)",
    )  # fmt: skip
    decode.add_argument(
        "--num-layers", type=int, default=None, metavar="N",
        help="keep only the first N of the target's layers (default: all): a short "
        "compilation whose Inductor output code (TORCH_LOGS=output_code) still holds every "
        "kind of kernel a round launches",
    )  # fmt: skip
    decode.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    decode.add_argument("--context", type=int, default=1024, help="committed tokens per slot")
    decode.add_argument("--rounds", type=int, default=20, help="timed rounds per point")
    decode.add_argument(
        "--profile-rounds", type=int, default=None, metavar="N",
        help="rounds profiled for idle time and kernels (default: --rounds; 0: no profile)",
    )  # fmt: skip
    decode.add_argument(
        "--draft-vocab", type=int, default=None, help="default: the shapes' (32000 for 8B, 70B)"
    )
    decode.add_argument(
        "--accept-length", type=float, default=5.39,
        help="mean accepted length (tokens per round) for the implied speculative tokens/s",
    )  # fmt: skip
    decode.add_argument("--modes", nargs="+", default=["plain", "spec"], choices=["plain", "spec"])
    decode.add_argument(
        "--tree", type=int, nargs=3, default=None, metavar=("D", "K", "N"),
        help="one tree for every bucket (default: the engine's per-bucket table)",
    )  # fmt: skip
    decode.add_argument(
        "--stochastic", action="store_true",
        help="stochastic trees, timed on sampling requests (temperature 1)",
    )  # fmt: skip
    decode.add_argument(
        "--prompt-length", type=int, default=0,
        help="also time the prefill of prompts this long (time to first token; 0: no)",
    )  # fmt: skip
    decode.add_argument(
        "--top-kernels", type=int, default=15,
        help="list this many of a round's costliest kernels per point, and of its draft "
        "phase alone (0: none)",
    )  # fmt: skip
    decode.add_argument(
        "--timeline", action="store_true",
        help="keep one profiled round's kernels in launch order in the JSON point "
        "(kernel_timeline: [name, start us, duration us] each) and print the round cut "
        "after each attention launch",
    )  # fmt: skip
    decode.add_argument(
        "--no-compile", action="store_true",
        help="run the rounds eagerly instead of compiling them with Inductor (still captured "
        "in CUDA graphs): seconds of warm-up instead of minutes, slower rounds",
    )  # fmt: skip
    decode.add_argument(
        "--no-draft-split", action="store_true",
        help="do not time the draft phase alone (compiled: one compilation less per tree)",
    )  # fmt: skip
    decode.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="split the target over N GPUs (ranks started here; the head is replicated)",
    )  # fmt: skip
    decode.add_argument("--json", default=None, help="write one JSON line per point here")
    decode.set_defaults(func=run_decode)


def run_decode(args: argparse.Namespace) -> int:
    """Every point, over `--tp` ranks (started here) when more than one."""
    if not torch.cuda.is_available():
        raise ValueError("bench decode needs a CUDA GPU")
    if args.profile_rounds is not None and not 0 <= args.profile_rounds <= args.rounds:
        raise ValueError(f"--profile-rounds must be in [0, --rounds={args.rounds}]")
    target_config(args)  # ValueError: --num-layers out of range
    if args.tp == 1:
        return decode_points(args, None)
    from ..models.tensor_parallel import local_config
    from ..runtime.ranks import spawn_ranks

    if args.tp < 1 or torch.cuda.device_count() < args.tp:
        raise ValueError(
            f"--tp {args.tp} needs that many GPUs (>= 1), {torch.cuda.device_count()} visible"
        )
    local_config(target_config(args), args.tp)  # ValueError: what does not divide
    ranks = spawn_ranks(args.tp, device_type="cuda", entry=_decode_rank, args=(args,))
    try:
        return decode_points(args, ranks)
    finally:
        ranks.close()


def target_config(args: argparse.Namespace) -> LlamaConfig:
    """The random target's config: the shapes', with only `--num-layers` layers if given."""
    config = SHAPES[args.shapes].target
    if args.num_layers is None:
        return config
    if not 1 <= args.num_layers <= config.num_layers:
        raise ValueError(
            f"--num-layers must be in [1, {config.num_layers}] for {args.shapes}, "
            f"got {args.num_layers}"
        )
    return dataclasses.replace(config, num_layers=args.num_layers)


def _decode_rank(ranks, args: argparse.Namespace) -> None:
    """A rank other than 0 of `bench decode --tp N`: the same rounds, nothing reported."""
    decode_points(args, ranks)


def decode_points(args: argparse.Namespace, ranks) -> int:
    """Every point of `bench decode` on this rank (the whole model without `ranks`); rank 0
    prints them."""
    from .decode_bench import bench_bucket
    from .kernel_bench import copy_bandwidth
    from .random_models import random_eagle3_head, random_target

    report = ranks is None or ranks.rank == 0
    shapes = SHAPES[args.shapes]
    split = f", split over {args.tp} GPUs (floor: one rank's)" if args.tp > 1 else ""
    layers = "" if args.num_layers is None else f", its first {args.num_layers} layers"
    execution = "eager" if args.no_compile else "compiled"
    device = torch.device("cuda") if ranks is None else ranks.device
    env = environment(device.type) | {
        "model": f"{shapes.description}{layers}, random bf16 weights{split}",
        "tensor_parallel": args.tp,
        "execution": execution,
    }
    bandwidth = copy_bandwidth(device=str(device)) if report else 1.0
    env["copy_bandwidth_gbps"] = bandwidth / 1e9
    if report:
        print(json.dumps(env), flush=True)
    # The same seed on every rank: replicated weights and the head agree.
    torch.manual_seed(0)
    sharding = None if ranks is None else ranks.sharding
    config = target_config(args)
    target = random_target(config, device=device, dtype=torch.bfloat16, sharding=sharding)
    head = random_eagle3_head(
        target,
        draft_vocab_size=args.draft_vocab or shapes.draft_vocab_size,
        dtype=torch.bfloat16,
        layer=config,
    )
    points = []
    sink = open(args.json, "w") if args.json and report else None  # noqa: SIM115
    try:
        for bucket, tree in _points(args):
            point = bench_bucket(
                target, head, bucket=bucket, tree=tree, context=args.context,
                num_rounds=args.rounds, bandwidth=bandwidth, compile=not args.no_compile,
                profile_rounds=args.profile_rounds, collectives=ranks is not None,
                draft_split=not args.no_draft_split,
                num_top_kernels=args.top_kernels, timeline=args.timeline,
                prompt_length=args.prompt_length,
            )  # fmt: skip
            points.append(point)
            if report:
                print(json.dumps(point | env), file=sink or sys.stdout, flush=True)
                print(format_kernel_table(point), file=sys.stderr, flush=True)
    finally:
        if sink:
            sink.close()
    if report:
        print(format_tables(points, accept_length=args.accept_length, execution=execution))
    return 0


def _points(args: argparse.Namespace) -> list[tuple[int, TreeShape | None]]:
    """(bucket, tree) of every point asked for, in order; tree None: the plain step."""
    trees = {1: TreeShape(*args.tree)} if args.tree else DEFAULT_TREES
    if args.stochastic:
        trees = stochastic_trees(trees)
    table = EngineConfig(buckets=tuple(args.buckets), trees=trees)
    points = []
    for bucket in args.buckets:
        for mode, tree in (("plain", None), ("spec", table.tree_for(bucket))):
            if mode in args.modes and not (mode == "spec" and tree is None):
                points.append((bucket, tree))
    return points


def format_tables(points: list[dict], *, accept_length: float, execution: str) -> str:
    """How the rounds ran, the decode table and the floor table."""
    return "\n\n".join(
        [
            EXECUTION[execution],
            format_decode_table(points, accept_length=accept_length),
            format_floor_table(points),
        ]
    )


def _by_bucket(points: list[dict]) -> list[tuple[int, dict | None, dict | None]]:
    """(bucket, plain point or None, speculative point or None), by bucket."""
    plain = {p["bucket"]: p for p in points if p["mode"] == "plain"}
    spec = {p["bucket"]: p for p in points if p["mode"] == "speculative"}
    return [(b, plain.get(b), spec.get(b)) for b in sorted(set(plain) | set(spec))]


def format_decode_table(points: list[dict], *, accept_length: float) -> str:
    """One row per bucket: plain step vs floor, speculative round vs plain step (`xplain`, the
    accepted length at which speculation breaks even), implied tokens/s at `accept_length`
    tokens per round (capped at the tree's D + 1), and the implied speed-up."""
    header = (
        f"{'B':>3} {'plain ms':>8} {'floor':>6} {'plain tok/s':>11} {'tree':>10} {'round ms':>8} "
        f"{'xplain':>6} {'draft ms':>8} {'verify ms':>9} {f'tok/s@{accept_length}':>11} "
        f"{'speedup':>7} {'idle':>5} {'warm s':>6} {'pool MiB':>8}"
    )
    rows = [header, "-" * len(header)]
    for bucket, p, s in _by_bucket(points):
        # A round emits at most D + 1 tokens, whatever the stated length.
        length = min(accept_length, s["tree"][0] + 1) if s else None
        spec_tps = bucket * length / s["round_ms"] * 1e3 if s else None
        ratio = s["round_ms"] / p["round_ms"] if s and p else None
        speedup = spec_tps / p["tokens_per_s"] if s and p else None
        rows.append(
            f"{bucket:>3} {fmt(p and p['round_ms'], '.2f'):>8} "
            f"{fmt(p and p['floor_fraction'], '.0%'):>6} {fmt(p and p['tokens_per_s']):>11} "
            f"{_tree_label(s):>10} "
            f"{fmt(s and s['round_ms'], '.2f'):>8} {fmt(ratio, '.2f'):>6} "
            f"{fmt(s and s['draft_ms'], '.2f'):>8} {fmt(s and s['verify_ms'], '.2f'):>9} "
            f"{fmt(spec_tps):>11} {fmt(speedup, '.2f'):>7} "
            f"{fmt((s or p)['gpu_idle'], '.1%'):>5} {fmt((s or p)['warmup_s']):>6} "
            f"{fmt((s or p)['graph_pool_mib'], '.0f'):>8}"
        )
    return "\n".join(rows)


def format_floor_table(points: list[dict]) -> str:
    """One row per bucket, one GPU's view: weights a plain step reads, the floor (weights over
    the copy bandwidth plus the plain step's collectives timed alone) and the plain step's
    fraction of it, then for the plain step and the round their collectives (count, time
    alone, share of the step)."""
    header = (
        f"{'B':>3} {'GB/GPU':>6} {'plain ms':>8} {'floor ms':>8} {'of floor':>8} "
        f"{'plain colls':>11} {'ms':>6} {'share':>6} {'round ms':>8} {'round colls':>11} "
        f"{'ms':>6} {'share':>6} {'xplain':>6}"
    )
    rows = [
        "floor = weights / copy bandwidth + the plain step's collectives alone (CUDA graph); "
        "collectives = all-reduces + the logits' all-gather",
        header,
        "-" * len(header),
    ]
    for bucket, p, s in _by_bucket(points):
        ratio = s["round_ms"] / p["round_ms"] if s and p else None
        rows.append(
            f"{bucket:>3} {fmt((p or s)['weight_gb'], '.2f'):>6} "
            f"{fmt(p and p['round_ms'], '.2f'):>8} {fmt(p and p['weight_floor_ms'], '.2f'):>8} "
            f"{fmt(p and p['weight_floor_fraction'], '.1%'):>8} {_collectives(p)} "
            f"{fmt(s and s['round_ms'], '.2f'):>8} {_collectives(s)} {fmt(ratio, '.2f'):>6}"
        )
    return "\n".join(rows)


def _collectives(point: dict | None) -> str:
    """A point's collectives: how many, their time alone (ms) and share of the round."""
    count = sum(point["collectives"].values()) if point else None
    ms, share = (point["collectives_ms"], point["collectives_share"]) if point else (None, None)
    return f"{fmt(count, 'd'):>11} {fmt(ms, '.2f'):>6} {fmt(share, '.1%'):>6}"


def _tree_label(point: dict | None) -> str:
    """'D,K,N' of a speculative point, with ',s' for a stochastic tree; '-' for none."""
    if not point:
        return "-"
    return ",".join(map(str, point["tree"])) + (",s" if point.get("stochastic") else "")


def format_kernel_table(point: dict) -> str:
    """A point's round: kernels launched and their time, then its costliest kernels."""
    tree = "" if point["tree"] is None else " tree " + ",".join(map(str, point["tree"]))
    lines = [
        f"B={point['bucket']} {point['mode']}{tree}: {point['round_ms']:.3f} ms per round, "
        f"{fmt(point['kernels_per_round'], '.0f')} kernels, "
        f"{fmt(point['kernel_us_per_round'], '.0f')} us in kernels, idle in graph "
        f"{fmt(point['gpu_idle_in_graph'], '.1%')}"
    ]
    if "prefill_ms" in point:
        lines.append(f"  prefill of {point['prompt_length']} tokens: {point['prefill_ms']:.2f} ms")
    lines += _kernel_rows(point["top_kernels"], indent="  ")
    if point.get("draft_top_kernels"):
        lines.append(
            f"  of which the draft phase alone: {point['draft_ms']:.3f} ms, "
            f"{point['draft_kernels_per_round']:.0f} kernels, "
            f"{point['draft_kernel_us_per_round']:.0f} us in kernels"
        )
        lines += _kernel_rows(point["draft_top_kernels"], indent="    ")
    if point.get("kernel_timeline"):
        pieces = attention_segments(point["kernel_timeline"])
        spans = " ".join(f"{span:.1f}" for _, _, span in pieces)
        lines.append(f"  the round cut after each attention (us, gaps included): {spans}")
    return "\n".join(lines)


def _kernel_rows(top_kernels: list, *, indent: str) -> list[str]:
    """One line per [name, launches per round, us per round] of a kernel table."""
    return [
        f"{indent}{micros:8.1f} us {launches:6.1f}x  {name}"
        for name, launches, micros in top_kernels
    ]


def summarize(lines: list[dict], *, accept_length: float = 5.39) -> str:
    """The tables of `bench decode` JSON lines (points with their environment), one set per
    (model, tensor parallelism, execution), in the order first seen."""
    groups: dict[tuple, list[dict]] = {}
    for line in lines:
        if "mode" in line:
            key = (line["model"], line["tensor_parallel"], line.get("execution", "compiled"))
            groups.setdefault(key, []).append(line)
    parts = []
    for (model, tp, execution), points in groups.items():
        tables = format_tables(points, accept_length=accept_length, execution=execution)
        parts.append(f"== {model} (TP={tp}, {execution})\n{tables}")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Print the tables of the JSON-lines files named on the command line."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--accept-length", type=float, default=5.39)
    args = parser.parse_args(argv)
    lines = [
        json.loads(text)
        for path in args.files
        for text in path.read_text().splitlines()
        if text.strip()
    ]
    print(summarize(lines, accept_length=args.accept_length))
    return 0


if __name__ == "__main__":
    sys.exit(main())
