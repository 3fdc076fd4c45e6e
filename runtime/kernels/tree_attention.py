"""`rt::tree_attention`: tree-masked attention over [committed KV cache | tree KV], in Triton.

The op computes what `models/attention.py` writes with a dense mask and SDPA, without ever
building the [M, S + N] mask or repeating K/V for GQA:

- prefix part: the slot's committed cache, positions [0, cache_len), no mask but the length,
  split over the sequence (flash-decoding split-K) so that small batches still fill the GPU,
  each split taking an equal share of the committed length (not of the cache size);
- tree part: the N tree keys, filtered per query by the int64 ancestor bitmask `anc`;
- the parts are merged by log-sum-exp: with one split a program runs one online softmax over
  prefix then tree; with several, the tree keys get a split of their own, and the last split
  of each row block to finish (an arrival counter per row block) merges the splits' partial
  outputs by their LSE in the same launch.

All Hq / Hkv query heads of a KV head are processed together: the "rows" of a tile are
(group head, tree query) pairs, so every K/V tile is loaded once per KV head. The launch grid
depends only on static shapes (never on `cache_len` values), which keeps the op CUDA-graph safe:
a split whose share is empty (a prefix shorter than the splits' key blocks) runs an empty loop
and contributes an empty (-inf) partial.

`tree_attention_ref` is the same function in plain PyTorch, written as an explicit two-part
softmax with an LSE merge; it is the CPU implementation of the op and the oracle in tests.
The kernels live in tree_attention_triton.py, imported at the first launch, so this module
loads without Triton, where the op runs the reference on every device (see _triton.py).
"""

from __future__ import annotations

import torch

from ._triton import rt_op, uses_triton
from .tree_attention_config import (
    check_inputs,
    launch_config,
    num_multiprocessors,
)

_BITS_PER_WORD = 64


@rt_op("rt::tree_attention")
def _tree_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    anc: torch.Tensor,
    *,
    scale: float,
    fixed_config: bool = False,
) -> torch.Tensor:
    # Also the fake impl and the decomposition torch.compile inlines: non-CUDA tensors
    # (CPU, meta), and any tensors without Triton, take the reference so the op traces and
    # compiles everywhere.
    if not uses_triton(q.device):
        out = tree_attention_ref(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, scale=scale)
        return in_output_layout(out)
    check_inputs(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, scale=scale)
    batch, num_q_heads, num_queries, head_dim = q.shape
    config = launch_config(
        batch=batch,
        num_kv_heads=k_cache.shape[1],
        num_rows=num_q_heads // k_cache.shape[1] * num_queries,
        cache_size=k_cache.shape[2],
        head_dim=head_dim,
        num_sms=num_multiprocessors(q.device),
        fixed=fixed_config,
    )
    # Imported here, not at the top: this module must load where Triton is missing.
    from .tree_attention_triton import launch_tree_attention

    return launch_tree_attention(
        q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, scale=scale, config=config
    )


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    anc: torch.Tensor,
    *,
    scale: float,
    fixed_config: bool = False,
) -> torch.Tensor:
    """Attention of M tree queries over [committed cache | N tree keys] (`rt::tree_attention`).

    Args:
        q: [B, Hq, M, D] queries (fp16/bf16/fp32 on CUDA; any float dtype on CPU).
        k_cache, v_cache: [B, Hkv, S, D] committed cache, any strides (e.g. a slice of a
            [L, B, Hkv, S, D] buffer); only positions [0, cache_len[b]) are read.
        cache_len: [B] int64 committed length per slot (0 <= cache_len <= S).
        k_tree, v_tree: [B, Hkv, N, D] tree keys/values.
        anc: [B, M, W] int64 bitmask: bit j of word j // 64 set iff query i sees tree key j.
        scale: softmax scale, usually D ** -0.5.
        fixed_config: one launch config whatever the shapes (see `launch_config`), for calls
            from graphs traced with dynamic shapes: the kernel variant compiled for one
            prompt length then serves every length, where the shape-tuned config would pick
            new tiles (and compile a new variant) for some lengths at run time.
    Returns:
        [B, Hq, M, D] in q's dtype; a query that sees no key at all gets zeros. Its memory is
        [B, M, Hq, D] (strides of a transpose) on every device, so the [B, M, Hq * D] input of
        the output projection is a view of it rather than a copy.
    """
    return torch.ops.rt.tree_attention(
        q, k_cache, v_cache, cache_len, k_tree, v_tree, anc, scale=scale, fixed_config=fixed_config
    )


def _softmax_part(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of masked scores [..., R, K] (-inf = masked) against v [..., K, D].

    Returns (normalised output [..., R, D], natural-log LSE [..., R]); rows with no visible key
    give output 0 and LSE -inf.
    """
    if scores.shape[-1] == 0:  # empty cache (S = 0): amax needs a non-empty dim
        out = scores.new_zeros((*scores.shape[:-1], v.shape[-1]))
        return out, scores.new_full(scores.shape[:-1], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out, (row_max + torch.log(denom)).squeeze(-1)


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    anc: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Plain-PyTorch `rt::tree_attention` (same arguments and result as `tree_attention`).

    GQA without repeating K/V: q is viewed as [B, Hkv, G * M, D] rows (head-major within the
    group, as in the kernel). Computes in float32 (float64 for float64 inputs).
    """
    batch, num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads, cache_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    rows = q.to(acc_dtype).reshape(batch, num_kv_heads, group * num_queries, head_dim) * scale

    positions = torch.arange(cache_size, device=q.device)
    in_prefix = (positions[None, :] < cache_len[:, None])[:, None, None, :]
    prefix_scores = (rows @ k_cache.to(acc_dtype).transpose(-1, -2)).masked_fill(
        ~in_prefix, float("-inf")
    )
    out_p, lse_p = _softmax_part(prefix_scores, v_cache.to(acc_dtype))

    node = torch.arange(k_tree.shape[2], device=q.device)
    bits = (anc[..., node // _BITS_PER_WORD] >> (node % _BITS_PER_WORD)) & 1  # [B, M, N]
    visible = (bits != 0)[:, None, None].expand(-1, -1, group, -1, -1)
    visible = visible.reshape(batch, 1, group * num_queries, -1)
    tree_scores = (rows @ k_tree.to(acc_dtype).transpose(-1, -2)).masked_fill(
        ~visible, float("-inf")
    )
    out_t, lse_t = _softmax_part(tree_scores, v_tree.to(acc_dtype))

    lse_max = torch.maximum(lse_p, lse_t)
    lse_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    w_p, w_t = torch.exp(lse_p - lse_max), torch.exp(lse_t - lse_max)
    total = w_p + w_t
    total = torch.where(total > 0, total, torch.ones_like(total))
    out = (w_p[..., None] * out_p + w_t[..., None] * out_t) / total[..., None]
    return out.reshape(batch, num_q_heads, num_queries, head_dim).to(q.dtype)


@_tree_attention_op.register_kernel("cpu")
def _tree_attention_cpu(
    *inputs: torch.Tensor, scale: float, fixed_config: bool = False
) -> torch.Tensor:
    """The op on the CPU: the reference (one implementation, no launch config to fix)."""
    return in_output_layout(tree_attention_ref(*inputs, scale=scale))


def in_output_layout(out: torch.Tensor) -> torch.Tensor:
    """`out` [B, Hq, M, D] with the op's memory order, [B, M, Hq, D], whatever it had."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)
