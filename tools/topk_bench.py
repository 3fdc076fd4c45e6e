"""`specrun bench topk`: the draft's top-k selections, rt::topk / rt::log_softmax_topk against
ATen, in microseconds per launch.

Each point is one selection a round makes: the root's children and each draft level's
frontier children (`log_softmax_topk` over the draft vocabulary, k = the frontier width) and
the rerank's best N of the tree's candidates (`topk`), timed as kernel_bench times
everything (CUDA-graph replays over rotating input copies). The contenders:

- `aten`: `torch.topk`, after a float32 `log_softmax` for the log-probability points (what
  the draft would run without the op);
- `rt`: the op with the launch form `topk_config` picks;
- `rt best` (`--sweep`): the fastest of a grid of launch forms (chunk width, warps, k
  max-reductions or one bitonic top-k), to check and refit that choice.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .kernel_bench import num_input_sets, time_or_skip

_SWEEP_BLOCKS = (256, 512, 1024, 2048, 4096)
_SWEEP_WARPS = (1, 2, 4, 8)
# A chunked row's merge holds chunks * k keys in one program: more spill registers.
_MAX_MERGE_KEYS = 8192


@dataclass(frozen=True)
class TopkPoint:
    """A selection: the top `k` of `num_rows` rows of `num_cols` entries, of their
    log-softmax when `log_softmax`."""

    name: str
    num_rows: int
    num_cols: int
    k: int
    log_softmax: bool


DEFAULT_POINTS = (
    # SmolLM2-135M's head (14,336-token draft vocabulary), the batch-1 tree (6, 8, 63).
    TopkPoint("root", 1, 14336, 8, True),
    TopkPoint("level", 8, 14336, 8, True),
    TopkPoint("rerank", 1, 8 + 5 * 64, 62, False),  # the best N - 1 of its 328 candidates
    # Llama-3.1-8B's head (32,000), a level at batch 1 and at batch 4.
    TopkPoint("root-8b", 1, 32000, 8, True),
    TopkPoint("level-8b", 8, 32000, 8, True),
    TopkPoint("level-8b-b4", 32, 32000, 8, True),
)


def parse_point(text: str) -> TopkPoint:
    """ROWS,COLS,K[,lsm] -> a point named by its numbers."""
    parts = text.split(",")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "lsm"):
        raise argparse.ArgumentTypeError(f"expected ROWS,COLS,K or ROWS,COLS,K,lsm, got {text!r}")
    try:
        num_rows, num_cols, k = (int(p) for p in parts[:3])
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"ROWS, COLS and K must be integers: {text!r}") from error
    if num_rows < 1 or not 1 <= k <= num_cols:
        raise argparse.ArgumentTypeError(f"need ROWS >= 1 and 1 <= K <= COLS, got {text!r}")
    return TopkPoint(text, num_rows, num_cols, k, len(parts) == 4)


def sweep_configs(point: TopkPoint) -> list:
    """The launch forms `--sweep` tries for `point` (chunks no wider than its rows' power of
    2, merges of at most _MAX_MERGE_KEYS keys), each selecting by max-reductions and by
    sort."""
    import triton

    from ..runtime.kernels.topk_triton import TopkConfig

    widest = triton.next_power_of_2(point.num_cols)
    grid = itertools.product(_SWEEP_BLOCKS, _SWEEP_WARPS, (False, True))
    configs = []
    for block, num_warps, by_sort in grid:
        num_chunks = triton.cdiv(point.num_cols, block)
        if block > widest or num_chunks * point.k > _MAX_MERGE_KEYS:
            continue
        configs.append(TopkConfig(block=block, num_warps=num_warps, by_sort=by_sort))
    return configs


def form_label(config: dict) -> str:
    """A launch form as the table writes it: b<block> w<warps>, `sort` for a bitonic one."""
    return f"b{config['block']} w{config['num_warps']}{' sort' if config['by_sort'] else ''}"


def _time(fn: Callable, xs: Sequence[torch.Tensor]) -> float | None:
    return time_or_skip([lambda x=x: fn(x) for x in xs])


def bench_topk(point: TopkPoint, *, sweep: bool, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One point: microseconds per launch of each contender, and whether the op's columns
    match ATen's on distinct values."""
    from ..runtime.kernels.topk_triton import launch_topk, topk_config

    shape = (point.num_rows, point.num_cols)
    xs = [
        torch.randn(shape, device="cuda", dtype=dtype) * 4
        for _ in range(num_input_sets(point.num_rows * point.num_cols * dtype.itemsize))
    ]
    k, log_softmax = point.k, point.log_softmax

    def aten(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(x.float().log_softmax(-1) if log_softmax else x, k, dim=-1)

    def rt(x: torch.Tensor, config=None) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_topk(x, k, log_softmax=log_softmax, config=config)

    result = asdict(point) | {"config": asdict(topk_config(point.num_rows, point.num_cols))}
    distinct = torch.randperm(point.num_rows * point.num_cols, device="cuda").view(shape)
    distinct = distinct.to(torch.float32)
    result["rt_matches_aten"] = torch.equal(
        launch_topk(distinct, k, log_softmax=log_softmax)[1], aten(distinct).indices
    )
    for label, fn in (("aten", aten), ("rt", rt)):
        seconds = _time(fn, xs)
        result[f"{label}_us"] = seconds * 1e6 if seconds else None
    if sweep:
        timed = [(_time(lambda x, c=c: rt(x, c), xs), c) for c in sweep_configs(point)]
        timed = [(seconds, c) for seconds, c in timed if seconds is not None]
        result["sweep_us"] = {form_label(asdict(c)): s * 1e6 for s, c in timed}
        if timed:
            seconds, config = min(timed, key=lambda pair: pair[0])
            result["best_us"] = seconds * 1e6
            result["best_config"] = asdict(config)
    return result


def row(point: dict) -> str:
    """One line of the summary table."""

    def micros(key: str) -> str:
        value = point.get(key)
        return f"{value:8.1f}" if value else "       -"

    best = point.get("best_config")
    best_text = "" if best is None else f" best {form_label(best)}"
    kind = "lsm" if point["log_softmax"] else "   "
    return (
        f"{point['name']:>12} {point['num_rows']:>4}x{point['num_cols']:<7} k={point['k']:<3}"
        f"{kind} {micros('aten_us')} {micros('rt_us')} {micros('best_us')}"
        f" {form_label(point['config'])}{best_text}"
        f"{'' if point['rt_matches_aten'] else ' MISMATCH'}"
    )


HEADER = "       point  rows x cols     k         aten       rt  rt best   (us; rt's form, best's)"
