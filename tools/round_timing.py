"""Timing and profiling of replayed steps on the GPU: the mean time of back-to-back replays
between two CUDA events (on the CPU, of eager calls on the host clock), and the kernels a
step launches under the profiler (how many, their summed time, the costliest by name, the
GPU's idle time between them, and one step's kernels in launch order).

Used by `specrun bench decode` (tools/decode_bench.py), tools/collectives.py and `specrun
bench train-draft --profile-steps` (tools/train_bench.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..runtime.reports import ReportReader

# Kernel names are cut to this many characters (Inductor's fused names run to hundreds).
NAME_WIDTH = 120


def time_replays(run, *, num_rounds: int, device: torch.device | str = "cuda") -> float:
    """Mean seconds of `run` over `num_rounds` back-to-back launches after one more: GPU time
    on CUDA (the current device), wall time on the CPU."""
    run()
    if torch.device(device).type != "cuda":
        started = time.perf_counter()
        for _ in range(num_rounds):
            run()
        return (time.perf_counter() - started) / num_rounds
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_rounds):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / num_rounds


@dataclass(frozen=True)
class KernelSpan:
    """One kernel execution seen by the profiler: name, start and end in microseconds."""

    name: str
    start: float
    end: float


def profile_kernels(run, *, num_rounds: int, host_loop: bool) -> list[KernelSpan]:
    """The kernels of `num_rounds` rounds, driven by the decoder's host loop (launch, copy the
    report out, read it one round behind) when `host_loop`, else replayed back to back."""
    from torch.profiler import ProfilerActivity, profile

    reader = ReportReader(torch.device("cuda"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(num_rounds):
            if not host_loop:
                run()
                continue
            while len(reader) <= 1:
                reader.submit(run)
            reader.read()
        torch.cuda.synchronize()
    return sorted(
        (
            KernelSpan(e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
        ),
        key=lambda k: (k.start, k.end),
    )


def idle_fraction(kernels: list[KernelSpan]) -> float | None:
    """1 - (union of kernel intervals) / span; None without kernels."""
    if not kernels:
        return None
    busy, current_start, current_end = 0.0, kernels[0].start, kernels[0].end
    for kernel in kernels[1:]:
        if kernel.start > current_end:
            busy += current_end - current_start
            current_start, current_end = kernel.start, kernel.end
        else:
            current_end = max(current_end, kernel.end)
    busy += current_end - current_start
    span = kernels[-1].end - kernels[0].start
    return max(0.0, 1.0 - busy / span) if span > 0 else None


def kernel_table(kernels: list[KernelSpan], *, num_rounds: int, top: int) -> dict:
    """Per round: kernels launched, their summed time (us), and the `top` costliest kernel
    names as [name, launches per round, us per round]."""
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        count[kernel.name] += 1
        total[kernel.name] += kernel.end - kernel.start
    costliest = sorted(total, key=total.get, reverse=True)[:top]
    return {
        "kernels_per_round": len(kernels) / num_rounds,
        "kernel_us_per_round": sum(total.values()) / num_rounds,
        "top_kernels": [
            [name[:NAME_WIDTH], count[name] / num_rounds, total[name] / num_rounds]
            for name in costliest
        ],
    }


def round_timeline(kernels: list[KernelSpan], *, num_rounds: int) -> list[list]:
    """One round's kernels in launch order, as [name, start, duration] in microseconds from
    the round's first kernel: the middle one of `num_rounds` back-to-back replays of the same
    graph (the same kernels each). Empty without kernels or when the count does not divide
    into rounds (the profiler dropped some: no round boundary can be trusted)."""
    if not kernels or num_rounds < 1 or len(kernels) % num_rounds:
        return []
    per_round = len(kernels) // num_rounds
    first = (num_rounds // 2) * per_round
    middle = kernels[first : first + per_round]
    origin = middle[0].start
    return [[k.name[:NAME_WIDTH], k.start - origin, k.end - k.start] for k in middle]


def attention_segments(timeline: list[list], *, marker: str = "_tree_attention_kernel") -> list:
    """A round's timeline (`round_timeline`) cut after each attention launch (kernels whose
    name starts with `marker`): per piece [kernels, microseconds in kernels, microseconds from
    the end of the previous piece's last kernel to the end of its own], the last piece the
    kernels after the last attention. A speculative round's first pieces are its draft
    levels (its first is the draft's extend and root), then one a verified layer, then the
    acceptance and commit."""
    pieces, kernels, busy, start = [], 0, 0.0, 0.0
    for name, begin, duration in timeline:
        kernels += 1
        busy += duration
        if name.startswith(marker):
            pieces.append([kernels, busy, begin + duration - start])
            kernels, busy, start = 0, 0.0, begin + duration
    if kernels:
        end = timeline[-1][1] + timeline[-1][2]
        pieces.append([kernels, busy, end - start])
    return pieces
