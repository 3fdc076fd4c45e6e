"""`specrun bench`: performance measurements, one sub-command per subject.

`specrun bench kernels`: rt::tree_attention vs SDPA with the equivalent dense mask vs the memory
floor, on Llama-3.1-8B attention shapes; one JSON line per point and a summary table.

`specrun bench cold-start`: process start to first token in fresh processes, with and without
ahead-of-time compile artifacts (tools/cold_start.py).

`specrun bench decode`: plain and speculative rounds per batch bucket with a known model's
shapes (Llama-3.1-8B by default) and an EAGLE-3-shaped head (random bf16 weights), against the
memory floor, with the kernels a round launches.

`specrun bench serve`: a load generator against a running `specrun serve` (HTTP; any device):
request throughput, output tokens/s, time to first token and inter-token latency percentiles
at Poisson arrival rates or fixed concurrencies (tools/serve_bench.py).

`specrun bench generate`: `specrun generate` per speculation policy and without a draft, on
the first built-in held-out prompts (tools/generate_bench.py; any device).
`specrun bench hf`: Hugging Face transformers `generate` on a real model at batch 1 (GPU or
CPU, bfloat16 or float32), the comparison point for `specrun eval`'s and `specrun bench
generate`'s numbers on the same prompts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch

from ..runtime.config import DEFAULT_BUCKETS, DEFAULT_TREES, EngineConfig, stochastic_trees
from ..runtime.tree import TreeShape
from . import cold_start, generate_bench, serve_bench
from .decode_bench import SHAPES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="performance benchmarks (most need a CUDA GPU)")
    subjects = parser.add_subparsers(dest="subject", required=True)
    kernels = subjects.add_parser(
        "kernels", help="rt::tree_attention vs SDPA with a dense mask vs the memory floor"
    )
    kernels.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    kernels.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    kernels.add_argument(
        "--trees", type=int, nargs="+", default=[1, 8, 32, 64], help="tree sizes N (M = N)"
    )
    kernels.add_argument("--json", default=None, help="write one JSON line per point here")
    kernels.set_defaults(func=run_kernels)
    decode = subjects.add_parser(
        "decode", help="plain and speculative round latency per bucket (random weights)"
    )
    decode.add_argument(
        "--shapes", default="llama-3.1-8b", choices=sorted(SHAPES),
        help="the target's shapes (and its head's draft vocabulary)",
    )  # fmt: skip
    decode.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_BUCKETS))
    decode.add_argument("--context", type=int, default=1024, help="committed tokens per slot")
    decode.add_argument("--rounds", type=int, default=20, help="timed rounds per point")
    decode.add_argument(
        "--draft-vocab", type=int, default=None, help="default: the shapes' (32000 for 8B)"
    )
    decode.add_argument(
        "--accept-length",
        type=float,
        default=5.39,
        help="mean accepted length (tokens per round) for the implied speculative tokens/s",
    )
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
        help="list this many of a round's costliest kernels per point (0: none)",
    )  # fmt: skip
    decode.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="split the target over N GPUs (ranks started here; the head is replicated)",
    )  # fmt: skip
    decode.add_argument("--json", default=None, help="write one JSON line per point here")
    decode.set_defaults(func=run_decode)
    hf = subjects.add_parser("hf", help="transformers generate at batch 1 on a real model")
    hf.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    hf.add_argument("--prompts", default="builtin:heldout", help="JSONL or builtin:NAME")
    hf.add_argument("--max-prompts", type=int, default=16)
    hf.add_argument("--max-new-tokens", type=int, default=256)
    hf.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    hf.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    hf.add_argument("--json", default=None, help="also write the JSON line here")
    hf.set_defaults(func=run_hf)
    cold_start.register(subjects)
    serve_bench.register(subjects)
    generate_bench.register(subjects)


def _environment(device: str = "cuda") -> dict:
    """Where a benchmark ran: the device's name (the CPU's model on the CPU) and versions."""
    on_cuda = device.startswith("cuda")
    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else _cpu_name(),
        "num_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["specrun", *sys.argv[1:]]),
    }


def _cpu_name() -> str:
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "cpu"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _row(point: dict) -> str:
    if "skipped" in point:
        return f"{point['num_tree']:>3} {point['cache_len']:>6} {point['batch']:>3}  skipped"
    sdpa = [t for t in (point["sdpa_gqa_us"], point["sdpa_expanded_us"]) if t is not None]
    speedup = min(sdpa) / point["kernel_us"] if sdpa and point["kernel_us"] else None
    return (
        f"{point['num_tree']:>3} {point['cache_len']:>6} {point['batch']:>3} "
        f"{point['floor_us']:>9.1f} {_fmt(point['kernel_us']):>9} "
        f"{_fmt(point.get('floor_fraction'), '.0%'):>6} {_fmt(point['sdpa_gqa_us']):>10} "
        f"{_fmt(point['sdpa_expanded_us']):>10} {_fmt(speedup, '.1f'):>6}x "
        f"{point['config']['num_splits']:>3} "
        f"{'yes' if point['meets_floor_target'] else 'NO':>4} "
        f"{'yes' if point['beats_sdpa'] else 'NO':>4}"
    )


HEADER = "  N      L   B  floor_us kernel_us  floor   sdpa_gqa  sdpa_expd  speedup spl  tgt sdpa"


def run_kernels(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU")
    from .kernel_bench import (
        bench_tree_attention,
        copy_bandwidth,
        tree_attention_shapes,
    )

    env = _environment()
    bandwidth = copy_bandwidth()
    env["copy_bandwidth_gbps"] = bandwidth / 1e9
    print(json.dumps(env))
    print("timing: CUDA-graph replay, rotating input sets > L2, median of 10 replays")
    shapes = tree_attention_shapes(batches=args.batch, lengths=args.lengths, trees=args.trees)
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    rows = []
    try:
        for shape in shapes:
            point = {"op": "rt::tree_attention"} | bench_tree_attention(shape, bandwidth=bandwidth)
            line = json.dumps(point | env)
            print(line, file=sink or sys.stdout, flush=True)
            rows.append(_row(point))
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        if sink:
            sink.close()
    print(HEADER)
    print("\n".join(rows))
    return 0


def run_decode(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench decode needs a CUDA GPU")
    if args.tp == 1:
        return _decode_points(args, None)
    from ..models.tensor_parallel import local_config
    from ..runtime.ranks import spawn_ranks

    if args.tp < 1 or torch.cuda.device_count() < args.tp:
        raise ValueError(
            f"--tp {args.tp} needs that many GPUs (>= 1), {torch.cuda.device_count()} visible"
        )
    local_config(SHAPES[args.shapes].target, args.tp)  # ValueError: what does not divide
    ranks = spawn_ranks(args.tp, device_type="cuda", entry=_decode_rank, args=(args,))
    try:
        return _decode_points(args, ranks)
    finally:
        ranks.close()


def _decode_rank(ranks, args: argparse.Namespace) -> None:
    """A rank other than 0 of `bench decode --tp N`: the same rounds, nothing reported."""
    _decode_points(args, ranks)


def _decode_points(args: argparse.Namespace, ranks) -> int:
    """Every point of `bench decode` on this rank (the whole model without `ranks`); rank 0
    prints them."""
    from .decode_bench import bench_bucket, random_eagle3_head, random_target
    from .kernel_bench import copy_bandwidth

    report = ranks is None or ranks.rank == 0
    shapes = SHAPES[args.shapes]
    draft_vocab = args.draft_vocab or shapes.draft_vocab_size
    split = f", split over {args.tp} GPUs (floor: one rank's)" if args.tp > 1 else ""
    env = _environment() | {
        "model": f"{shapes.description}, random bf16 weights{split}",
        "tensor_parallel": args.tp,
    }
    bandwidth = copy_bandwidth() if report else 1.0
    env["copy_bandwidth_gbps"] = bandwidth / 1e9
    if report:
        print(json.dumps(env))
    # The same seed on every rank: replicated weights and the head agree.
    torch.manual_seed(0)
    sharding = None if ranks is None else ranks.sharding
    device = "cuda" if ranks is None else ranks.device
    target = random_target(shapes.target, device=device, dtype=torch.bfloat16, sharding=sharding)
    head = random_eagle3_head(target, draft_vocab_size=draft_vocab, dtype=torch.bfloat16)
    trees = {1: TreeShape(*args.tree)} if args.tree else DEFAULT_TREES
    if args.stochastic:
        trees = stochastic_trees(trees)
    table = EngineConfig(buckets=tuple(args.buckets), trees=trees)
    points = []
    sink = open(args.json, "w") if args.json and report else None  # noqa: SIM115
    try:
        for bucket in args.buckets:
            modes = [("plain", None), ("spec", table.tree_for(bucket))]
            for mode, tree in modes:
                if mode not in args.modes or (mode == "spec" and tree is None):
                    continue
                point = bench_bucket(
                    target, head, bucket=bucket, tree=tree, context=args.context,
                    num_rounds=args.rounds, bandwidth=bandwidth,
                    num_top_kernels=args.top_kernels, prompt_length=args.prompt_length,
                )  # fmt: skip
                points.append(point)
                if report:
                    print(json.dumps(point | env), file=sink or sys.stdout, flush=True)
                    print(format_kernel_table(point), file=sys.stderr, flush=True)
    finally:
        if sink:
            sink.close()
    if report:
        print(format_decode_table(points, accept_length=args.accept_length))
    return 0


def format_decode_table(points: list[dict], *, accept_length: float) -> str:
    """One row per bucket: plain step vs floor, speculative round vs plain step (`xplain`, the
    accepted length at which speculation breaks even), implied tokens/s at `accept_length`
    tokens per round (capped at the tree's D + 1), and the implied speed-up."""
    plain = {p["bucket"]: p for p in points if p["mode"] == "plain"}
    spec = {p["bucket"]: p for p in points if p["mode"] == "speculative"}
    header = (
        f"{'B':>3} {'plain ms':>8} {'floor':>6} {'plain tok/s':>11} {'tree':>10} {'round ms':>8} "
        f"{'xplain':>6} {'draft ms':>8} {'verify ms':>9} {f'tok/s@{accept_length}':>11} "
        f"{'speedup':>7} {'idle':>5} {'warm s':>6} {'pool MiB':>8}"
    )
    rows = [header, "-" * len(header)]
    for bucket in sorted(set(plain) | set(spec)):
        p, s = plain.get(bucket), spec.get(bucket)
        # A round emits at most D + 1 tokens, whatever the stated length.
        length = min(accept_length, s["tree"][0] + 1) if s else None
        spec_tps = bucket * length / s["round_ms"] * 1e3 if s else None
        ratio = s["round_ms"] / p["round_ms"] if s and p else None
        speedup = spec_tps / p["tokens_per_s"] if s and p else None
        rows.append(
            f"{bucket:>3} {_fmt(p and p['round_ms'], '.2f'):>8} "
            f"{_fmt(p and p['floor_fraction'], '.0%'):>6} {_fmt(p and p['tokens_per_s']):>11} "
            f"{_tree_label(s):>10} "
            f"{_fmt(s and s['round_ms'], '.2f'):>8} {_fmt(ratio, '.2f'):>6} "
            f"{_fmt(s and s['draft_ms'], '.2f'):>8} {_fmt(s and s['verify_ms'], '.2f'):>9} "
            f"{_fmt(spec_tps):>11} {_fmt(speedup, '.2f'):>7} "
            f"{_fmt((s or p)['gpu_idle'], '.1%'):>5} {_fmt((s or p)['warmup_s']):>6} "
            f"{_fmt((s or p)['graph_pool_mib'], '.0f'):>8}"
        )
    return "\n".join(rows)


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
        f"{point['kernels_per_round']:.0f} kernels, {point['kernel_us_per_round']:.0f} us in "
        f"kernels, idle in graph {_fmt(point['gpu_idle_in_graph'], '.1%')}"
    ]
    if "prefill_ms" in point:
        lines.append(f"  prefill of {point['prompt_length']} tokens: {point['prefill_ms']:.2f} ms")
    for name, launches, micros in point["top_kernels"]:
        lines.append(f"  {micros:8.1f} us {launches:6.1f}x  {name}")
    return "\n".join(lines)


def run_hf(args: argparse.Namespace) -> int:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU; use --device cpu")
    from ..models.default import default_model_dir
    from ..runtime.distill.data import read_prompts
    from .hf_bench import hf_generate_point

    prompts = read_prompts(args.prompts)[: args.max_prompts]
    model_dir = args.model or default_model_dir()
    point = hf_generate_point(
        model_dir,
        prompts,
        max_new_tokens=args.max_new_tokens,
        device=device,
        dtype=getattr(torch, args.dtype),
    )
    line = json.dumps(point | {"model": str(model_dir)} | _environment(device))
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(f"transformers generate: {point['tokens_per_second']:.1f} tok/s")
    return 0
