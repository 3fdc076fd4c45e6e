"""`specrun bench`: performance measurements, one sub-command per subject.

`specrun bench kernels`: rt::tree_attention vs SDPA with the equivalent dense mask vs the memory
floor, on a model's attention shapes (Llama-3.1-8B by default), optionally with the fastest of
a grid of launch configs beside the launch table's (`--sweep`); one JSON line per point and a
summary table.

`specrun bench skinny-mm`: the decode step's matrix products (a few rows times each weight of
Llama-3.1-8B), rt::skinny_mm against cuBLAS and Inductor, in bytes/s (tools/skinny_mm_bench.py).

`specrun bench topk`: the draft's top-k selections (the root's and each level's children,
the rerank), rt::topk and rt::log_softmax_topk against ATen, in microseconds
(tools/topk_bench.py).

`specrun bench gpt-fast`: gpt-fast's own decoding loop (a checkout the caller fetched, never
vendored) on random weights at batch 1, run beside `bench decode` for the side-by-side
(tools/gpt_fast_bench.py).

`specrun bench cold-start`: process start to first token in fresh processes, with and without
ahead-of-time compile artifacts (tools/cold_start.py).

`specrun bench decode`: plain and speculative rounds per batch bucket with a known model's
shapes (Llama-3.1-8B by default, or 70B) and an EAGLE-3-shaped head (random bf16 weights),
against the memory floor, with the kernels a round launches; compiled or eager
(`--no-compile`), on one GPU or split over several (`--tp N`, with the collectives' share of
each round) (tools/decode_cli.py).

`specrun bench serve`: a load generator against a running `specrun serve` (HTTP; any device):
request throughput, output tokens/s, time to first token and inter-token latency percentiles
at Poisson arrival rates or fixed concurrencies (tools/serve_bench.py).

`specrun bench generate`: `specrun generate` per speculation policy and without a draft, on
the first built-in held-out prompts (tools/generate_bench.py; any device).
`specrun bench train-draft`: what `specrun train-draft` costs for a known model's shapes with
random weights: answering prompts (response tokens/s with the compiled plain decoder) and
training steps of a head (steps/s, peak memory) (tools/train_bench.py; any device).
`specrun bench hf`: Hugging Face transformers `generate` on a real model at batch 1 (GPU or
CPU, bfloat16 or float32), the comparison point for `specrun eval`'s and `specrun bench
generate`'s numbers on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable

import torch

from ..runtime.kernels.skinny_mm import MAX_ROWS
from . import cold_start, decode_cli, generate_bench, gpt_fast_bench, serve_bench, train_bench
from .bench_env import environment, fmt
from .random_models import SHAPES


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
    kernels.add_argument(
        "--model", choices=sorted(SHAPES), default="llama-3.1-8b", help="whose attention shapes"
    )
    kernels.add_argument(
        "--cache-size",
        type=int,
        default=0,
        help="positions in each slot's cache, >= every length (default: each length's own)",
    )
    kernels.add_argument(
        "--sweep", action="store_true", help="also time a grid of launch configs (best_us)"
    )
    kernels.add_argument("--json", default=None, help="write one JSON line per point here")
    kernels.set_defaults(func=run_kernels)
    skinny = subjects.add_parser(
        "skinny-mm", help="rt::skinny_mm vs cuBLAS vs Inductor on a decode step's products"
    )
    skinny.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    skinny.add_argument(
        "--model", choices=sorted(SHAPES), default="llama-3.1-8b", help="whose weight shapes"
    )
    skinny.add_argument("--shapes", nargs="+", default=None, help="of qkv o gate_up down lm_head")
    skinny.add_argument("--sweep", action="store_true", help="also time a grid of tilings")
    skinny.add_argument("--json", default=None, help="write one JSON line per point here")
    skinny.set_defaults(func=run_skinny_mm)
    register_topk(subjects)
    hf = subjects.add_parser("hf", help="transformers generate at batch 1 on a real model")
    hf.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    hf.add_argument("--prompts", default="builtin:heldout", help="JSONL or builtin:NAME")
    hf.add_argument("--max-prompts", type=int, default=16)
    hf.add_argument("--max-new-tokens", type=int, default=256)
    hf.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    hf.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    hf.add_argument("--json", default=None, help="also write the JSON line here")
    hf.set_defaults(func=run_hf)
    decode_cli.register(subjects)
    gpt_fast_bench.register(subjects)
    cold_start.register(subjects)
    serve_bench.register(subjects)
    generate_bench.register(subjects)
    train_bench.register(subjects)


def _row(point: dict) -> str:
    if "skipped" in point:
        return f"{point['num_tree']:>3} {point['cache_len']:>6} {point['batch']:>3}  skipped"
    sdpa = [t for t in (point["sdpa_gqa_us"], point["sdpa_expanded_us"]) if t is not None]
    speedup = min(sdpa) / point["kernel_us"] if sdpa and point["kernel_us"] else None
    return (
        f"{point['num_tree']:>3} {point['cache_len']:>6} {point['batch']:>3} "
        f"{point['floor_us']:>9.1f} {fmt(point['kernel_us']):>9} "
        f"{fmt(point.get('floor_fraction'), '.0%'):>6} {fmt(point['sdpa_gqa_us']):>10} "
        f"{fmt(point['sdpa_expanded_us']):>10} {fmt(speedup, '.1f'):>6}x "
        f"{point['config']['num_splits']:>3} "
        f"{'yes' if point['meets_floor_target'] else 'NO':>4} "
        f"{'yes' if point['beats_sdpa'] else 'NO':>4}"
        f"{_best(point)}"
    )


def _best(point: dict) -> str:
    """The sweep's fastest config, where one ran: time and rows/keys/splits."""
    best = point.get("best_config")
    if best is None:
        return ""
    tiles = f"r{best['block_r']}/n{best['block_n']}/s{best['num_splits']}"
    return f" {point['best_us']:>8.1f} {tiles}"


HEADER = (
    "  N      L   B  floor_us kernel_us  floor   sdpa_gqa  sdpa_expd  speedup spl  tgt sdpa"
    "  [best_us config]"
)


def run_kernels(args: argparse.Namespace) -> int:
    if args.cache_size and args.cache_size < max(args.lengths):
        raise ValueError(f"--cache-size {args.cache_size} is below --lengths {max(args.lengths)}")
    if not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU")
    from .kernel_bench import (
        bench_tree_attention,
        copy_bandwidth,
        tree_attention_shapes,
    )

    env = environment()
    bandwidth = copy_bandwidth()
    env["copy_bandwidth_gbps"] = bandwidth / 1e9
    print(json.dumps(env))
    print("timing: CUDA-graph replay, rotating input sets > L2, median of 10 replays")
    shapes = tree_attention_shapes(
        batches=args.batch,
        lengths=args.lengths,
        trees=args.trees,
        config=SHAPES[args.model].target,
        cache_size=args.cache_size,
    )
    points = (
        {"op": "rt::tree_attention", "model": args.model}
        | bench_tree_attention(shape, bandwidth=bandwidth, sweep=args.sweep)
        for shape in shapes
    )
    _print_points(points, env=env, json_path=args.json, row=_row, header=HEADER)
    return 0


def _print_points(
    points: Iterable[dict],
    *,
    env: dict,
    json_path: str | None,
    row: Callable[[dict], str],
    header: str,
) -> None:
    """Each point as a JSON line with `env` (to `json_path`, else stdout) and its table row on
    stderr as it comes, then the whole table on stdout."""
    sink = open(json_path, "w") if json_path else None  # noqa: SIM115
    rows = []
    try:
        for point in points:
            print(json.dumps(point | env), file=sink or sys.stdout, flush=True)
            rows.append(row(point))
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        if sink:
            sink.close()
    print(header)
    print("\n".join(rows))


def run_skinny_mm(args: argparse.Namespace) -> int:
    from .kernel_bench import copy_bandwidth
    from .skinny_mm_bench import HEADER as SKINNY_HEADER
    from .skinny_mm_bench import bench_skinny_mm, step_weight_shapes
    from .skinny_mm_bench import row as skinny_row

    weight_shapes = step_weight_shapes(SHAPES[args.model].target)
    unknown = set(args.shapes or ()) - set(weight_shapes)
    if unknown:
        raise ValueError(f"unknown --shapes {sorted(unknown)}; choose from {list(weight_shapes)}")
    if not 1 <= min(args.rows) <= max(args.rows) <= MAX_ROWS:
        raise ValueError(f"--rows must lie in [1, {MAX_ROWS}], got {args.rows}")
    if not torch.cuda.is_available():
        raise ValueError("bench skinny-mm needs a CUDA GPU")
    env = environment()
    env["copy_bandwidth_gbps"] = copy_bandwidth() / 1e9
    print(json.dumps(env))
    points = (
        {"op": "rt::skinny_mm"}
        | {"model": args.model}
        | bench_skinny_mm(name, *weight_shapes[name], num_rows, sweep=args.sweep)
        for name in args.shapes or weight_shapes
        for num_rows in args.rows
    )
    _print_points(points, env=env, json_path=args.json, row=skinny_row, header=SKINNY_HEADER)
    return 0


def register_topk(subjects: argparse._SubParsersAction) -> None:
    from .topk_bench import DEFAULT_POINTS, parse_point

    topk = subjects.add_parser(
        "topk", help="rt::topk / rt::log_softmax_topk vs ATen on the draft's selections"
    )
    topk.add_argument(
        "--points", type=parse_point, nargs="+", default=list(DEFAULT_POINTS),
        metavar="ROWS,COLS,K[,lsm]",
        help="selections to time (lsm: of the rows' log-softmax); default: the draft's for "
        "SmolLM2-135M's and Llama-3.1-8B's heads",
    )  # fmt: skip
    topk.add_argument("--sweep", action="store_true", help="also time a grid of launch forms")
    topk.add_argument("--json", default=None, help="write one JSON line per point here")
    topk.set_defaults(func=run_topk)


def run_topk(args: argparse.Namespace) -> int:
    from .topk_bench import HEADER as TOPK_HEADER
    from .topk_bench import bench_topk
    from .topk_bench import row as topk_row

    if not torch.cuda.is_available():
        raise ValueError("bench topk needs a CUDA GPU")
    env = environment()
    print(json.dumps(env))
    points = ({"op": "rt::topk"} | bench_topk(point, sweep=args.sweep) for point in args.points)
    _print_points(points, env=env, json_path=args.json, row=topk_row, header=TOPK_HEADER)
    return 0


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
    line = json.dumps(point | {"model": str(model_dir)} | environment(device))
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(f"transformers generate: {point['tokens_per_second']:.1f} tok/s")
    return 0
