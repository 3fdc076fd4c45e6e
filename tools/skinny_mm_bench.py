"""`specrun bench skinny-mm`: the decode step's matrix products, rt::skinny_mm against cuBLAS and
Inductor, in bytes per second.

Each point is one weight shape of a model (`--model`, Llama-3.1-8B by default: the fused q/k/v, the
attention output, the fused gate/up, the MLP down projection and the LM head) times a few rows
of activations, timed as kernel_bench times everything (CUDA-graph replays, rotating over
enough weight copies to cover the L2 several times). The contenders:

- `cublas`: `x @ w.T` as ATen runs it (cuBLAS; what a compiled step calls for an mm by default);
- `inductor` (one row only): `F.linear` compiled with coordinate-descent tuning (gpt-fast's
  setting), under which Inductor rewrites one-row products as an elementwise product and a
  sum it generates and tunes itself (more rows fall back to cuBLAS: the `cublas` column);
- `rt`: rt::skinny_mm with the tiling `skinny_mm_config` picks;
- `rt best` (`--sweep`): the fastest of a grid of tilings, to check and refit that choice.

Bandwidth counts the bytes the product must move (w, x and the output, each once).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..models.config import LlamaConfig
from ..runtime.kernels.skinny_mm import skinny_mm
from .kernel_bench import num_input_sets, time_or_skip


def step_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each weight a decode step multiplies its rows by, as models/llama.py stores
    them: q/k/v and gate/up fused, the LM head last."""
    attention = config.num_heads * config.head_dim
    key_value = config.num_kv_heads * config.head_dim
    return {
        "qkv": (attention + 2 * key_value, config.hidden_size),
        "o": (config.hidden_size, attention),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size),
        "lm_head": (config.vocab_size, config.hidden_size),
    }


def sweep_configs(num_rows: int) -> list:
    """The tilings `--sweep` tries for `num_rows` rows of x: elementwise ones for one row,
    tensor-core ones for more."""
    from ..runtime.kernels.skinny_mm_triton import SkinnyMMConfig

    use_dot = num_rows > 1
    if use_dot:
        grid = itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4, 5))
    else:
        grid = itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8), (1, 3))
    return [
        SkinnyMMConfig(block_n=n, block_k=k, num_warps=w, num_stages=s, use_dot=use_dot)
        for n, k, w, s in grid
    ]


def _weight_copies(n: int, k: int, *, dtype: torch.dtype) -> list[torch.Tensor]:
    num_copies = num_input_sets(n * k * dtype.itemsize)
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(num_copies)]


def _time(fn: Callable, xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor]) -> float | None:
    return time_or_skip([lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws, strict=True)])


def _inductor_linear() -> Callable:
    torch._dynamo.reset()  # each point's shapes compile afresh, under no recompile limit
    compiled = torch.compile(F.linear, dynamic=False, fullgraph=True)

    def call(x, w):
        with torch._inductor.config.patch(coordinate_descent_tuning=True):
            return compiled(x, w)

    return call


def bench_skinny_mm(
    name: str, n: int, k: int, num_rows: int, *, sweep: bool, dtype: torch.dtype = torch.bfloat16
) -> dict:
    """One point: seconds and bytes/s of each contender for x [num_rows, k] @ w [n, k]^T."""
    from ..runtime.kernels.skinny_mm_triton import launch_skinny_mm, skinny_mm_config

    ws = _weight_copies(n, k, dtype=dtype)
    xs = [torch.randn(num_rows, k, device="cuda", dtype=dtype) for _ in ws]
    num_bytes = (n * k + num_rows * (k + n)) * dtype.itemsize
    want = xs[0].float() @ ws[0].float().T
    point = {"shape": name, "n": n, "k": k, "rows": num_rows, "bytes": num_bytes}
    point["config"] = asdict(skinny_mm_config(num_rows, n, k))
    error = (skinny_mm(xs[0], ws[0]).float() - want).abs().max().item()
    point["rt_max_abs_error"] = error
    contenders = {"cublas": lambda x, w: x @ w.T, "rt": skinny_mm}
    if num_rows == 1:
        contenders["inductor"] = _inductor_linear()
    for label, fn in contenders.items():
        seconds = _time(fn, xs, ws)
        point[f"{label}_us"] = seconds * 1e6 if seconds else None
        point[f"{label}_gbps"] = num_bytes / seconds / 1e9 if seconds else None
    if sweep:
        best = None
        for config in sweep_configs(num_rows):
            seconds = _time(lambda x, w, c=config: launch_skinny_mm(x, w, config=c), xs, ws)
            if seconds is not None and (best is None or seconds < best[0]):
                best = (seconds, config)
        if best is not None:
            point["best_us"] = best[0] * 1e6
            point["best_gbps"] = num_bytes / best[0] / 1e9
            point["best_config"] = asdict(best[1])
    return point


def row(point: dict) -> str:
    """One line of the summary table."""

    def gbps(key: str) -> str:
        value = point.get(key)
        return f"{value:8.0f}" if value else "       -"

    best = point.get("best_config")
    best_text = (
        ""
        if best is None
        else (
            f" best n{best['block_n']} k{best['block_k']} w{best['num_warps']} "
            f"s{best['num_stages']}"
        )
    )
    return (
        f"{point['shape']:>8} {point['n']:>6}x{point['k']:<6} {point['rows']:>3} "
        f"{gbps('cublas_gbps')} {gbps('inductor_gbps')} {gbps('rt_gbps')} {gbps('best_gbps')}"
        f"{best_text}"
    )


HEADER = "   shape          n x k    rows  cublas inductor      rt  rt best   (GB/s)"
