"""Launch configuration for `rt::tree_attention`: a fixed heuristic table keyed on static shapes,
and the input checks of the CUDA path.

No autotuning: the choice depends only on shapes known at trace time (batch, heads, tree size,
cache size S, head dim) and the device's multiprocessor count, so it is deterministic at
CUDA-graph capture and never depends on `cache_len` values (the kernel shares the prefix out by
them at run time instead). Shapes that are symbolic at trace time (the dynamic prefill's batch
and length) get one fixed config: branching on them would guard the compiled graph to the range
of the example it was traced with. The many-row numbers were tuned on an H100 (BENCHMARKS.md,
"Kernels: rt::tree_attention"), the small batches' tiles and splits on an H200 (BENCHMARKS.md,
"Tree attention for small batches: 16-row tiles, splits only for few rows").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

# Caches of at most this many positions per slot (the engine's default 2048, `bench decode`'s
# 4.5k) take the small-batch table measured on them; longer ones keep the table tuned for long
# contexts, where 16-row tiles would read every K/V block once per 16 rows.
_SHORT_CACHE = 4608
# Below one program per multiprocessor, the prefix is split until there are about this many.
_SHORT_CACHE_PROGRAMS_PER_SM = 1
_LONG_CACHE_PROGRAMS_PER_SM = 2
# A split of a full cache reads at least this many key blocks, so its partial write stays small
# next to it.
_MIN_BLOCKS_PER_SPLIT = 4
# Prefix splits + the tree split stay <= 64: a row block's last split merges them in turn.
_MAX_SPLITS = 63
# Past this many output rows (slots x query heads x tree queries) the prefix of a short cache
# is not split: the partials' writes and their merge cost more than the splits gain.
_MAX_SPLIT_OUTPUT_ROWS = 1024
_BITS_PER_WORD = 64
# A dynamic call's rows per KV head are assumed many (a prefill).
_DYNAMIC_NUM_ROWS = 64


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and split-K layout of one `rt::tree_attention` launch.

    block_r: rows (group heads x tree queries) per program; block_n: keys per inner step;
    num_splits: how many ranges each slot's committed prefix [0, cache_len) is cut into,
    in equal shares of whole key blocks (past one, the tree keys get a split too, and the
    last split of each row block to finish merges the partials); min_split_len: the fewest
    keys a share holds (a multiple of block_n), so that a prefix shorter than num_splits of
    them runs on fewer splits.
    """

    block_r: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    min_split_len: int = 0

    def __post_init__(self) -> None:
        for name in ("block_r", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if not 1 <= self.num_splits <= _MAX_SPLITS:
            raise ValueError(f"num_splits={self.num_splits} must be in [1, {_MAX_SPLITS}]")
        if self.min_split_len < 0 or self.min_split_len % self.block_n:
            raise ValueError(
                f"min_split_len={self.min_split_len} must be a multiple of block_n={self.block_n}"
            )


# triton.cdiv and triton.next_power_of_2 on host ints, written out so that the config (and the
# fusion pass's input checks) load where Triton is missing.
def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1, where only max(16, ...) reads it)."""
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _num_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_multiprocessors(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached; no sync)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_multiprocessors(index)


def _many_slot_block_r(num_rows: int) -> int:
    """Rows per program where the slots alone fill the GPU: few rows (<= 32: decode, small
    trees) are bandwidth-bound, many are bound by the tensor cores and the softmax, where
    64-row blocks measured faster than 128-row blocks (which also overflow shared memory at
    64 keys and 3 stages)."""
    return min(max(16, _next_power_of_2(num_rows)), 64)


def _tile_shape(
    num_rows: int, head_dim: int, *, num_slot_heads: int, num_sms: int, short_cache: bool
) -> tuple[int, int]:
    """(block_r, block_n) for `num_rows` rows per KV head and `num_slot_heads` (slot, KV head)
    pairs.

    Long caches: `_many_slot_block_r`, 64-key blocks for few rows (bandwidth-bound) and 32 for
    many. Short caches: where 16-row tiles take no more programs than there are
    multiprocessors (small batches), they run: the call is bound by latency, and more,
    shorter programs finish sooner; few rows per KV head read 32-key blocks, many 64 where the
    tiles are 16 rows.
    """
    block_r = _many_slot_block_r(num_rows)
    if not short_cache:
        return block_r, 64 if block_r <= 32 and head_dim <= 128 else 32
    if num_slot_heads * _cdiv(num_rows, 16) <= num_sms:
        block_r = 16
    return block_r, 64 if block_r == 16 and num_rows > 32 and head_dim <= 128 else 32


def num_prefix_splits(
    *, num_programs: int, cache_size: int, block_n: int, num_sms: int, programs_per_sm: int
) -> int:
    """How many ranges the prefix is split into for `num_programs` programs per split and a
    cache of `cache_size` keys: none once the programs cover the multiprocessors (merging
    partials costs more than it gains), else about `programs_per_sm` programs per multiprocessor
    (a short committed prefix uses fewer of them: see the kernel)."""
    num_blocks = max(1, _cdiv(cache_size, block_n))
    wanted = 1
    if num_programs < num_sms:
        wanted = _cdiv(programs_per_sm * num_sms, num_programs)
    return max(1, min(wanted, num_blocks // _MIN_BLOCKS_PER_SPLIT, _MAX_SPLITS))


def launch_config(
    *,
    batch: int | torch.SymInt,
    num_kv_heads: int,
    num_rows: int | torch.SymInt,
    cache_size: int | torch.SymInt,
    head_dim: int,
    num_sms: int,
    fixed: bool = False,
) -> LaunchConfig:
    """The launch config for one call.

    Args:
        batch, num_kv_heads: B and Hkv.
        num_rows: rows per KV head, (Hq / Hkv) * M.
        cache_size: static cache length S (not the committed lengths).
        head_dim: D.
        num_sms: multiprocessors of the device.

    If batch, num_rows or cache_size is symbolic (traced with dynamic shapes), or `fixed`,
    the config reads none of them: many-row tiles and one split over the whole prefix.
    Caches of at most `_SHORT_CACHE` positions take the small-batch table, longer ones the
    long-context one.
    """
    if fixed or not all(is_concrete_int(size) for size in (batch, num_rows, cache_size)):
        return _fixed_launch_config(head_dim)
    short_cache = cache_size <= _SHORT_CACHE
    block_r, block_n = _tile_shape(
        num_rows,
        head_dim,
        num_slot_heads=batch * num_kv_heads,
        num_sms=num_sms,
        short_cache=short_cache,
    )
    num_programs = batch * num_kv_heads * _cdiv(num_rows, block_r)
    num_splits = 1
    if not short_cache or batch * num_kv_heads * num_rows <= _MAX_SPLIT_OUTPUT_ROWS:
        num_splits = num_prefix_splits(
            num_programs=num_programs,
            cache_size=cache_size,
            block_n=block_n,
            num_sms=num_sms,
            programs_per_sm=(
                _SHORT_CACHE_PROGRAMS_PER_SM if short_cache else _LONG_CACHE_PROGRAMS_PER_SM
            ),
        )
    # A third stage pays on long per-program loops, not on short split ranges of few rows.
    long_loop = num_splits == 1 or block_r > 32
    return LaunchConfig(
        block_r=block_r,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=4,
        num_stages=3 if long_loop and head_dim <= 128 else 2,
    )


def _fixed_launch_config(head_dim: int) -> LaunchConfig:
    block_r, block_n = _tile_shape(
        _DYNAMIC_NUM_ROWS, head_dim, num_slot_heads=1, num_sms=1, short_cache=False
    )
    return LaunchConfig(
        block_r=block_r,
        block_n=block_n,
        num_splits=1,
        num_warps=4,
        num_stages=3 if head_dim <= 128 else 2,
    )


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    anc: torch.Tensor,
    *,
    scale: float,
) -> None:
    """Raise ValueError unless the CUDA kernels take these tree_attention arguments (static
    metadata only: no device sync)."""
    batch, num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if k_cache.shape != v_cache.shape or k_cache.shape[::3] != (batch, head_dim):
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} vs q")
    if k_tree.shape != v_tree.shape or k_tree.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"tree K/V shapes {tuple(k_tree.shape)}, {tuple(v_tree.shape)} vs cache")
    if anc.shape[:2] != (batch, num_queries) or anc.shape[2] * _BITS_PER_WORD < k_tree.shape[2]:
        raise ValueError(f"anc shape {tuple(anc.shape)} vs {num_queries} queries, tree K/V")
    if cache_len.shape != (batch,) or cache_len.dtype != torch.int64 or anc.dtype != torch.int64:
        raise ValueError("cache_len must be [B] int64 and anc int64")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"head dim {head_dim} must be a power of two in [16, 256]")
    if not scale > 0:
        raise ValueError(f"scale must be positive, not {scale}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rt::tree_attention on CUDA takes fp16/bf16/fp32, not {q.dtype}")
