"""`specrun bench`: performance measurements, one sub-command per subject.

`specrun bench kernels`: rt::tree_attention vs SDPA with the equivalent dense mask vs the memory
floor, on Llama-3.1-8B attention shapes; one JSON line per point and a summary table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="performance benchmarks (needs a CUDA GPU)")
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


def _environment() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["specrun", *sys.argv[1:]]),
    }


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
