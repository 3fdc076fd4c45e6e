"""The Triton kernels of `rt::tree_attention` and their launcher.

Imported only where Triton is installed, by the op's CUDA path in tree_attention.py
(and by tuning sweeps and the TRITON_INTERPRET tests): tree_attention.py states what the op
computes and holds its reference, which every other caller runs. Launch configs come from
tree_attention_config.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import wrap
from .arrivals import arrival_counters
from .tree_attention_config import LaunchConfig

_LOG2E = 1.4426950408889634
# Partial outputs (x rows) one merge load reads: splits * head_dim.
_MERGE_FLOATS = 512


@triton.jit
def _softmax_block(
    q, k, v, visible, m_i, l_i, acc, qk_scale,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step (base 2, running max in scaled units) of q [R, D] over a key
    block k, v [K, D]; `visible` [R, K] is applied only when MASKED."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    # scale > 0, so max(qk) * scale = max(qk * scale), and qk * scale - m is one FMA.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _prefix_step(
    q, kc_base, vc_base, skc_s, svc_s, start, hi, keys, m_i, l_i, acc, qk_scale,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Load cache keys [start, start + BLOCK_N) (masked to < hi when MASKED) and attend."""
    pos = start + keys
    if MASKED:
        key_ok = pos < hi
        k = tl.load(kc_base + pos[:, None] * skc_s, mask=key_ok[:, None], other=0.0)
        v = tl.load(vc_base + pos[:, None] * svc_s, mask=key_ok[:, None], other=0.0)
        visible = key_ok[None, :]
    else:
        k = tl.load(kc_base + pos[:, None] * skc_s)
        v = tl.load(vc_base + pos[:, None] * svc_s)
        visible = None
    return _softmax_block(q, k, v, visible, m_i, l_i, acc, qk_scale, MASKED, DOT_PRECISION)


@triton.jit
def _prefix_share(cache_len, num_splits, min_split_len, BLOCK_N: tl.constexpr):
    """(keys per prefix split, prefix splits with keys, whether one program does it all): the
    committed length cut into num_splits - 1 equal ranges of whole key blocks, each at least
    `min_split_len` keys and one block, so that a short prefix runs on fewer splits, or on one
    program together with the tree keys, and the other splits return at once."""
    share = tl.cdiv(tl.cdiv(cache_len, num_splits - 1), BLOCK_N) * BLOCK_N
    share = tl.maximum(tl.maximum(share, min_split_len), BLOCK_N)
    num_used = tl.cdiv(cache_len, share)
    return share, num_used, num_used <= 1


# Arguments that vary with a prefill's prompt length: left unspecialised (Triton would
# otherwise compile a variant per "== 1" / "% 16 == 0" case), so the kernel compiled for one
# length, at warm-up or in ahead-of-time artifacts, serves every length that gets the same
# launch config; so does the minimum share, which only a sweep varies.
_UNSPECIALISED_ARGS = ("sa_b", "sa_m", "num_queries", "num_tree", "min_split_len")


@triton.jit(do_not_specialize=_UNSPECIALISED_ARGS)
def _tree_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, cache_len_ptr, kt_ptr, vt_ptr, anc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr,
    sq_b, sq_h, sq_m, sq_d,
    skc_b, skc_h, skc_s, skc_d,
    svc_b, svc_h, svc_s, svc_d,
    skt_b, skt_h, skt_n, skt_d,
    svt_b, svt_h, svt_n, svt_d,
    sa_b, sa_m, sa_w,
    num_kv_heads, num_queries, num_tree, cache_size, num_splits, min_split_len, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr, PEEL_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (row block, split, slot * kv head).

    With one split, a program attends to the whole prefix and then the tree keys and writes
    the output. Otherwise split 0 takes the tree keys and splits 1 .. num_splits - 1 share the
    slot's committed prefix in equal ranges of whole key blocks, cut from its length, not from
    the cache size (`_prefix_share`); each split with keys writes a normalised partial output
    and its base-2 LSE, then counts itself in `arrivals` [row blocks * B * Hkv] int32; the
    last of a row block's splits to arrive merges the partials into the output and zeroes its
    counter again (arrivals.py: one launch where split-K attention takes a combine kernel).
    The tree split comes first so that it is scheduled first: it is the longest program
    where the prefix is short. Where one share holds the whole prefix, split 0 attends to it
    as well and writes the output, and the other splits return at once.
    PEEL_TAIL runs full prefix blocks unmasked and masks only the last one: it pays where the
    tensor cores bind (many rows) and costs occupancy where bandwidth binds (few rows)."""
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    slot_head = tl.program_id(2)
    b = (slot_head // num_kv_heads).to(tl.int64)
    kv_head = (slot_head % num_kv_heads).to(tl.int64)

    lo = 0
    hi = tl.minimum(tl.load(cache_len_ptr + b).to(tl.int32), cache_size)
    direct = True  # this program writes the output (no partials)
    num_used = 0  # prefix splits with keys
    if WRITE_PARTIALS:
        share, num_used, direct = _prefix_share(hi, num_splits, min_split_len, BLOCK_N)
        if (split > 0) & (direct | (split > num_used)):
            return  # no keys for this split: no partial to merge
        lo = tl.maximum(split - 1, 0) * share
        hi = tl.where(split == 0, tl.where(direct, hi, 0), tl.minimum(lo + share, hi))

    rows = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < GROUP * num_queries
    m_idx = rows % num_queries
    head = kv_head * GROUP + rows // num_queries
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK_N)

    q_rows = q_ptr + b * sq_b + head * sq_h + m_idx * sq_m
    q = tl.load(q_rows[:, None] + dims[None, :] * sq_d, mask=row_ok[:, None], other=0.0)

    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64
    # Finite start so fully masked rows give alpha = 1, p = 0 instead of NaN.
    m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)

    kc_base = kc_ptr + b * skc_b + kv_head * skc_h + dims[None, :] * skc_d
    vc_base = vc_ptr + b * svc_b + kv_head * svc_h + dims[None, :] * svc_d
    if PEEL_TAIL:
        full_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, full_end, BLOCK_N):
            m_i, l_i, acc = _prefix_step(
                q, kc_base, vc_base, skc_s, svc_s, start, hi, keys, m_i, l_i, acc, qk_scale,
                MASKED=False, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
        if full_end < hi:
            m_i, l_i, acc = _prefix_step(
                q, kc_base, vc_base, skc_s, svc_s, full_end, hi, keys, m_i, l_i, acc, qk_scale,
                MASKED=True, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _prefix_step(
                q, kc_base, vc_base, skc_s, svc_s, start, hi, keys, m_i, l_i, acc, qk_scale,
                MASKED=True, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip

    if split == 0:
        kt_base = kt_ptr + b * skt_b + kv_head * skt_h + dims[None, :] * skt_d
        vt_base = vt_ptr + b * svt_b + kv_head * svt_h + dims[None, :] * svt_d
        anc_rows = anc_ptr + b * sa_b + m_idx * sa_m
        for start in range(0, num_tree, BLOCK_N):
            node = start + keys
            key_ok = node < num_tree
            k = tl.load(kt_base + node[:, None] * skt_n, mask=key_ok[:, None], other=0.0)
            v = tl.load(vt_base + node[:, None] * svt_n, mask=key_ok[:, None], other=0.0)
            word_ptrs = anc_rows[:, None] + (node // 64)[None, :] * sa_w
            both_ok = row_ok[:, None] & key_ok[None, :]
            words = tl.load(word_ptrs, mask=both_ok, other=0)
            bits = (words >> (node % 64).to(tl.int64)[None, :]) & 1
            m_i, l_i, acc = _softmax_block(
                q, k, v, both_ok & (bits != 0), m_i, l_i, acc, qk_scale, MASKED=True,
                DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    # Output rows in (slot, query, head) order: the [B, M, Hq, D] layout the output
    # projection reads, so that no copy is needed to bring the heads together.
    out_rows = (b * num_queries + m_idx) * (GROUP * num_kv_heads) + head
    if direct:
        out_ptrs = out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part_rows = out_rows * num_splits + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)
        part_ptrs = part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(part_ptrs, o, mask=row_ok[:, None])
        # Every thread's partial before the arrival (a CTA barrier, then the counter's
        # acq_rel atomic at GPU scope publishes them): the last writer reads them all.
        tl.debug_barrier()
        arrivals = arrivals_ptr + slot_head * tl.num_programs(0) + row_block
        if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == num_used:
            tl.store(arrivals, 0)
            o = _merge_partials(part_out_ptr, part_lse_ptr, out_rows * num_splits, num_used,
                                row_ok, dims, MERGE_SPLITS)  # fmt: skip
            out_ptrs = out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_partials(
    part_out_ptr, part_lse_ptr, first_part, num_used, row_ok, dims, SPLITS: tl.constexpr
):  # fmt: skip
    """The output rows [R, D] float32 from their partials by base-2 LSE: the tree split and
    the `num_used` prefix splits that had keys, at partial rows first_part [R] + split, SPLITS
    splits a load (online across loads). Loads bypass L1 (.cg): other programs wrote these."""
    m = tl.full(first_part.shape, float("-inf"), tl.float32)
    denom = tl.zeros(first_part.shape, tl.float32)
    acc = tl.zeros([first_part.shape[0], dims.shape[0]], tl.float32)
    for start in range(0, num_used + 1, SPLITS):
        split = start + tl.arange(0, SPLITS)
        ok = row_ok[:, None] & (split <= num_used)[None, :]
        part_rows = first_part[:, None] + split[None, :]
        lse = tl.load(part_lse_ptr + part_rows, mask=ok, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        part = tl.load(part_out_ptr + part_rows[:, :, None] * dims.shape[0] + dims[None, None, :],
                       mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, tl.max(lse, 1))
        # Rows with no keys yet keep m = -inf: shift by 0 so that no -inf - -inf appears.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        weight = tl.exp2(lse - shift[:, None])
        denom = denom * alpha + tl.sum(weight, 1)
        acc = acc * alpha[:, None] + tl.sum(weight[:, :, None] * part, 1)
        m = m_new
    return acc / tl.where(denom > 0.0, denom, 1.0)[:, None]


def launch_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    anc: torch.Tensor,
    *,
    scale: float,
    config: LaunchConfig,
) -> torch.Tensor:
    """Run the Triton kernels with an explicit launch config (shapes as in `tree_attention`).

    Used by the op (config from `launch_config`), by tuning sweeps and by the interpreter tests.
    """
    batch, num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads, cache_size = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(
        (batch, num_queries, num_q_heads, head_dim), dtype=q.dtype, device=q.device
    ).transpose(1, 2)
    # Past one prefix split, the tree keys get a split of their own (see the kernel).
    num_splits = config.num_splits + 1 if config.num_splits > 1 else 1
    num_out_rows = batch * num_q_heads * num_queries
    if num_splits > 1:
        part_out = torch.empty(
            (num_out_rows, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_out_rows, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    group = num_q_heads // num_kv_heads
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(group * num_queries, config.block_r), num_splits, batch * num_kv_heads)
    # Passed whatever the splits: the kernel's merge branch is compiled (dead) in single-split
    # variants too, and needs an int32 pointer there.
    arrivals = arrival_counters(q, grid[0] * grid[2])
    wrap(_tree_attention_kernel)[grid](
        q, k_cache, v_cache, cache_len, k_tree, v_tree, anc,
        out, part_out, part_lse, arrivals,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *k_tree.stride(), *v_tree.stride(), *anc.stride(),
        num_kv_heads, num_queries, k_tree.shape[2], cache_size, num_splits,
        config.min_split_len, scale * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_R=config.block_r, BLOCK_N=config.block_n,
        WRITE_PARTIALS=num_splits > 1, PEEL_TAIL=config.block_r >= 64,
        DOT_PRECISION=dot_precision, MERGE_SPLITS=max(1, _MERGE_FLOATS // head_dim),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
