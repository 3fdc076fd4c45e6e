"""Kernel benchmarks: CUDA-graph timing, the measured memory floor, rt::tree_attention vs SDPA.

Timing method: the calls are captured into one CUDA graph (no launch overhead, no host gaps),
round-robin over enough independent input sets that their working set exceeds the L2 cache
several times (so small problems are not timed out of L2), and the graph is replayed with
device events around each replay; the reported time is the median replay over the number of
calls in it. The memory floor is the bytes the op must move (every slot's K/V in [0, cache_len),
the tree K/V, q and the output, each once) over the device-to-device copy bandwidth measured
here (bytes read + bytes written per second of a large `copy_`).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..models.config import LlamaConfig
from ..runtime.kernels.tree_attention import tree_attention
from ..runtime.kernels.tree_attention_config import (
    LaunchConfig,
    launch_config,
    num_multiprocessors,
)

logger = logging.getLogger(__name__)

_BITS_PER_WORD = 64
_L2_SWEEPS = 4  # rotating input sets cover at least this many L2 sizes
_MAX_INPUT_SETS = 32


def time_cuda_graph(
    calls: Sequence[Callable[[], object]], *, target_ms: float = 4.0, num_replays: int = 10
) -> float:
    """Median seconds per call of `calls`, replayed round-robin from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up: compile and allocate outside the capture
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for call in calls:
            call()
        end.record(stream)
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / len(calls), 1e-3)
    num_calls = len(calls) * max(1, min(1000 // len(calls), math.ceil(target_ms / estimate_ms)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_calls):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(num_replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / num_calls)
    del graph
    return statistics.median(times)


def copy_bandwidth(*, num_bytes: int = 1 << 31, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = time_cuda_graph([lambda: dst.copy_(src)], target_ms=20.0)
    return num_bytes / seconds


@dataclass(frozen=True)
class TreeAttentionShape:
    """One benchmark point: B slots at committed length L in a cache of S positions (0: S = L),
    an N-node tree (M = N queries), Llama-3.1-8B attention by default."""

    batch: int
    cache_len: int
    num_tree: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    cache_size: int = 0

    @property
    def num_positions(self) -> int:
        """S: the cache's positions, what the launch table sees (the kernel reads [0, L))."""
        return self.cache_size or self.cache_len

    @property
    def num_rows(self) -> int:
        """Rows per KV head: query heads per KV head x tree queries."""
        return self.num_q_heads // self.num_kv_heads * self.num_tree

    def floor_bytes(self) -> int:
        """Fewest bytes the op moves: cache K/V [0, L), tree K/V, q and out, each once."""
        return self._bytes(self.cache_len)

    def input_bytes(self) -> int:
        """Bytes one input set takes: the whole cache, tree K/V, q and out."""
        return self._bytes(self.num_positions)

    def _bytes(self, num_cache_keys: int) -> int:
        item = self.dtype.itemsize
        kv = 2 * self.batch * self.num_kv_heads * (num_cache_keys + self.num_tree) * self.head_dim
        q_out = 2 * self.batch * self.num_q_heads * self.num_tree * self.head_dim
        return (kv + q_out) * item


def random_tree_anc(batch: int, num_tree: int, *, generator: torch.Generator) -> torch.Tensor:
    """Ancestor bitmask [batch, N, W] int64 of random trees (node i's parent uniform in [0, i))."""
    num_words = max(1, -(-num_tree // _BITS_PER_WORD))
    anc = torch.zeros(batch, num_tree, num_words, dtype=torch.int64)
    for b in range(batch):
        masks = [1]
        for i in range(1, num_tree):
            parent = int(torch.randint(0, i, (), generator=generator))
            masks.append(masks[parent] | (1 << i))
        for i, mask in enumerate(masks):
            for w in range(num_words):
                word = (mask >> (_BITS_PER_WORD * w)) & ((1 << _BITS_PER_WORD) - 1)
                anc[b, i, w] = word - (1 << _BITS_PER_WORD) if word >> 63 else word
    return anc


def tree_attention_inputs(shape: TreeAttentionShape, *, seed: int, device: str = "cuda") -> dict:
    """Random rt::tree_attention arguments for `shape` (keyword dict, scale included)."""
    s = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, device=device, dtype=s.dtype)

    cache = (s.batch, s.num_kv_heads, s.num_positions, s.head_dim)
    tree = (s.batch, s.num_kv_heads, s.num_tree, s.head_dim)
    return {
        "q": randn(s.batch, s.num_q_heads, s.num_tree, s.head_dim),
        "k_cache": randn(*cache),
        "v_cache": randn(*cache),
        "cache_len": torch.full((s.batch,), s.cache_len, dtype=torch.int64, device=device),
        "k_tree": randn(*tree),
        "v_tree": randn(*tree),
        "anc": random_tree_anc(s.batch, s.num_tree, generator=gen).to(device),
        "scale": s.head_dim**-0.5,
    }


def dense_sdpa_inputs(inputs: dict, *, expand_kv: bool) -> dict:
    """SDPA arguments equivalent to `inputs`: concatenated K/V and the dense additive mask
    (the reference's), built ahead; with `expand_kv`, K/V repeated to the query heads."""
    q, k_cache, cache_len, anc = inputs["q"], inputs["k_cache"], inputs["cache_len"], inputs["anc"]
    num_tree = inputs["k_tree"].shape[2]
    node = torch.arange(num_tree, device=q.device)
    visible_tree = ((anc[..., node // _BITS_PER_WORD] >> (node % _BITS_PER_WORD)) & 1).bool()
    positions = torch.arange(k_cache.shape[2], device=q.device)
    visible_prefix = (positions[None, :] < cache_len[:, None])[:, None, :]
    visible = torch.cat([visible_prefix.expand(-1, q.shape[2], -1), visible_tree], dim=-1)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill(~visible, float("-inf"))[:, None]
    k = torch.cat([k_cache, inputs["k_tree"]], dim=2)
    v = torch.cat([inputs["v_cache"], inputs["v_tree"]], dim=2)
    group = q.shape[1] // k.shape[1]
    if expand_kv:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    gqa = k.shape[1] != q.shape[1]
    return {"query": q, "key": k, "value": v, "attn_mask": mask, "scale": inputs["scale"],
            "enable_gqa": gqa}  # fmt: skip


def num_input_sets(num_bytes: int) -> int:
    """How many independent input sets of `num_bytes` each the timing rotates over, so that
    together they cover the L2 `_L2_SWEEPS` times (at most `_MAX_INPUT_SETS`)."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    wanted = math.ceil(_L2_SWEEPS * l2_bytes / max(1, num_bytes))
    return max(1, min(_MAX_INPUT_SETS, wanted))


def time_or_skip(calls: Sequence[Callable[[], object]]) -> float | None:
    """time_cuda_graph (2 ms of calls a replay), or None where the calls do not compile or
    launch (a launch form beyond the device's shared memory, say): a sweep skips those."""
    try:
        return time_cuda_graph(calls, target_ms=2.0)
    except Exception as error:
        logger.info("skipped: %s", str(error).splitlines()[0] if str(error) else error)
        return None


def _time_or_none(calls: Sequence[Callable[[], object]]) -> float | None:
    """time_cuda_graph, or None if the calls run out of device memory."""
    try:
        return time_cuda_graph(calls)
    except torch.OutOfMemoryError:
        logger.info("out of memory; point skipped")
        torch.cuda.empty_cache()
        return None


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def _time_sdpa(input_sets: list[dict], *, expand_kv: bool) -> tuple[float | None, torch.Tensor]:
    try:
        sdpa_sets = [dense_sdpa_inputs(x, expand_kv=expand_kv) for x in input_sets]
        out = F.scaled_dot_product_attention(**sdpa_sets[0])
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None
    seconds = _time_or_none([lambda x=x: F.scaled_dot_product_attention(**x) for x in sdpa_sets])
    return seconds, out


def sweep_configs(shape: TreeAttentionShape) -> list[LaunchConfig]:
    """The launch configs `--sweep` tries on `shape`: row tiles up to the rows per KV head,
    key blocks of 16-64, 1-32 prefix splits, stages as the launch table sets them."""
    max_block_r = max(16, 1 << max(shape.num_rows - 1, 0).bit_length())
    grid = itertools.product((16, 32, 64), (16, 32, 64), (1, 2, 4, 8, 16, 32))
    return [
        LaunchConfig(
            block_r=block_r,
            block_n=block_n,
            num_splits=num_splits,
            num_warps=4,
            num_stages=3 if block_r >= 64 or num_splits == 1 else 2,
        )
        for block_r, block_n, num_splits in grid
        if block_r <= max_block_r
    ]


def _sweep(shape: TreeAttentionShape, input_sets: list[dict], out: torch.Tensor) -> dict:
    """The fastest of `sweep_configs` on these inputs (each config's output checked against
    the launch table's), as JSON fields."""
    import triton

    from ..runtime.kernels.tree_attention_triton import launch_tree_attention

    best_us, best_config = None, None
    for config in sweep_configs(shape):
        try:
            swept = launch_tree_attention(**input_sets[0], config=config)
        except triton.runtime.errors.OutOfResources:  # more shared memory than the device has
            continue
        if _relative_error(swept, out) > 1e-2:
            raise AssertionError(f"{config} disagrees with the launch table's config on {shape}")
        seconds = _time_or_none(
            [lambda x=x, c=config: launch_tree_attention(**x, config=c) for x in input_sets]
        )
        if seconds is not None and (best_us is None or seconds * 1e6 < best_us):
            best_us, best_config = seconds * 1e6, asdict(config)
    return {"best_us": best_us, "best_config": best_config}


def bench_tree_attention(
    shape: TreeAttentionShape, *, bandwidth: float, sweep: bool = False
) -> dict:
    """Time rt::tree_attention, SDPA in the reference's formulation (GQA + dense mask) and SDPA
    with K/V pre-expanded to the query heads (so a mask-capable fused backend can run), on one
    shape; with `sweep`, also the fastest of `sweep_configs` (`best_us`, `best_config`).
    Returns a JSON-ready dict; times in microseconds, None where out of memory."""
    free, _ = torch.cuda.mem_get_info()
    num_sets = num_input_sets(shape.floor_bytes())
    need = shape.input_bytes() * num_sets
    point = {k: str(v) if k == "dtype" else v for k, v in asdict(shape).items()}
    point |= {"num_queries": shape.num_tree, "floor_bytes": shape.floor_bytes()}
    point["floor_us"] = shape.floor_bytes() / bandwidth * 1e6
    if need > 0.45 * free:
        return point | {"skipped": f"needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"}
    input_sets = [tree_attention_inputs(shape, seed=i) for i in range(num_sets)]
    seconds = _time_or_none([lambda x=x: tree_attention(**x) for x in input_sets])
    out = tree_attention(**input_sets[0])
    point["kernel_us"] = seconds * 1e6 if seconds is not None else None
    point["num_input_sets"] = len(input_sets)
    config = launch_config(
        batch=shape.batch,
        num_kv_heads=shape.num_kv_heads,
        num_rows=shape.num_rows,
        cache_size=shape.num_positions,
        head_dim=shape.head_dim,
        num_sms=num_multiprocessors(out.device),
    )
    point["config"] = asdict(config)
    if sweep:
        point |= _sweep(shape, input_sets, out)
    for name, expand in (("sdpa_gqa", False), ("sdpa_expanded", True)):
        seconds, ref = _time_sdpa(input_sets, expand_kv=expand)
        point[f"{name}_us"] = seconds * 1e6 if seconds is not None else None
        if ref is not None:
            point[f"{name}_rel_err"] = _relative_error(out, ref)
        del ref
        torch.cuda.empty_cache()
    return point | _verdict(point)


def _verdict(point: dict) -> dict:
    """rt::tree_attention's targets: >= 80% of the floor where the floor is >= 40 us, else within
    floor + 10 us; and faster than the fastest SDPA that ran."""
    kernel, floor = point["kernel_us"], point["floor_us"]
    if kernel is None:
        return {"meets_floor_target": False, "beats_sdpa": False}
    meets = floor / kernel >= 0.8 if floor >= 40.0 else kernel <= floor + 10.0
    sdpa = [t for t in (point["sdpa_gqa_us"], point["sdpa_expanded_us"]) if t is not None]
    return {
        "floor_fraction": floor / kernel,
        "meets_floor_target": meets,
        "beats_sdpa": bool(sdpa) and kernel < min(sdpa),
    }


def tree_attention_shapes(
    *,
    batches: Sequence[int],
    lengths: Sequence[int],
    trees: Sequence[int],
    config: LlamaConfig | None = None,
    cache_size: int = 0,
) -> list[TreeAttentionShape]:
    """The benchmark grid, small to large: `config`'s attention (Llama-3.1-8B's by default),
    in a cache of `cache_size` positions (0: each committed length's own)."""
    heads = {}
    if config is not None:
        heads = {
            "num_q_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
        }
    return [
        TreeAttentionShape(batch=b, cache_len=length, num_tree=n, cache_size=cache_size, **heads)
        for n in trees
        for length in lengths
        for b in batches
    ]
