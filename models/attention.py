"""Reference tree attention: the single place attention is written.

Queries of M new nodes per slot attend to
  (a) the slot's committed KV cache, positions [0, cache_len), with no mask but the length, and
  (b) N tree keys (the new nodes, possibly after earlier tree nodes kept in a side buffer),
      filtered by an ancestor bitmask: query i sees tree key j iff bit j of anc[i] is set.

A causal prompt chunk is the special case of a chain (`chain_ancestors`), a plain decode step
the case M = N = 1. This is written the natural way (boolean mask, concatenated K/V, SDPA);
`runtime/passes` recognises the pattern after tracing and swaps in `rt::tree_attention`, so
the [M, S + N] mask is never built on the fast path. Keep the pattern recognisable: change it
and the pass together. Run eagerly on the CPU, a forward builds the mask once for all its layers
(`host_attention_mask`), reading the slots' lengths to attend to the longest one's cache only,
instead of the whole [0, S) buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BITS_PER_WORD = 64


def num_mask_words(num_nodes: int) -> int:
    """int64 words needed for an ancestor bitmask over `num_nodes` tree keys."""
    return max(1, -(-num_nodes // BITS_PER_WORD))


def expand_ancestor_mask(anc: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Unpack an ancestor bitmask into a boolean mask.

    Args:
        anc: [..., W] int64; bit j of word j // 64 set iff key j is visible.
        num_keys: number of tree keys N (N <= 64 * W).
    Returns:
        [..., N] bool.
    """
    key = torch.arange(num_keys, device=anc.device)
    words = anc[..., key // BITS_PER_WORD]
    return ((words >> (key % BITS_PER_WORD)) & 1).bool()


def pack_ancestor_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask [..., N] into int64 words [..., ceil(N / 64)] (inverse of expand)."""
    num_keys = mask.shape[-1]
    num_words = num_mask_words(num_keys)
    padded = F.pad(mask.to(torch.int64), (0, num_words * BITS_PER_WORD - num_keys))
    bits = padded.view(*mask.shape[:-1], num_words, BITS_PER_WORD)
    shifts = torch.arange(BITS_PER_WORD, device=mask.device, dtype=torch.int64)
    return (bits << shifts).sum(-1)


def key_bits(keys: torch.Tensor, num_words: int) -> torch.Tensor:
    """The bitmask of one tree key each: keys [...] int64 (each < 64 * num_words) ->
    [..., num_words] int64 with only bit `key` set. ORed into a packed mask, it adds the key
    without unpacking the mask."""
    word = torch.arange(num_words, device=keys.device)
    bit = torch.ones_like(keys) << (keys % BITS_PER_WORD)
    return torch.where(word == (keys // BITS_PER_WORD)[..., None], bit[..., None], 0)


def chain_ancestors(batch: int, length: int, device: torch.device | str) -> torch.Tensor:
    """Causal (chain) ancestor bitmask: node i sees nodes 0..i. Returns [batch, length, W]."""
    idx = torch.arange(length, device=device)
    causal = idx[None, :] <= idx[:, None]
    return pack_ancestor_mask(causal).expand(batch, length, -1)


def attention_mask(
    cache_len: torch.Tensor,
    anc: torch.Tensor,
    *,
    num_queries: int,
    cache_size: int,
    num_tree_keys: int,
) -> torch.Tensor:
    """What each query sees of [committed cache | tree keys].

    Args:
        cache_len: [B] int, committed length per slot.
        anc: [B, M, W] int64 ancestor bitmask over the tree keys.
        num_queries: M.
        cache_size: cache positions S the mask covers (the buffer's, or fewer).
        num_tree_keys: tree keys N (side buffer + new nodes).
    Returns:
        [B, 1, M, S + N] bool, broadcast over heads.
    """
    positions = torch.arange(cache_size, device=anc.device)
    prefix_mask = (positions[None, :] < cache_len[:, None])[:, None, :]
    tree_mask = expand_ancestor_mask(anc, num_tree_keys)
    return torch.cat([prefix_mask.expand(-1, num_queries, -1), tree_mask], dim=-1)[:, None]


def host_attention_mask(
    cache_len: torch.Tensor, anc: torch.Tensor, *, num_tree_keys: int
) -> torch.Tensor | None:
    """The mask of every layer of one eager CPU forward, built once and cut to the longest
    slot's cache (`attention_mask` over [0, max(cache_len))); None where the values cannot
    be read (`readable_on_host`), where each layer builds the full mask itself."""
    if not readable_on_host(cache_len):
        return None
    longest = int(cache_len.max()) if cache_len.numel() else 0
    return attention_mask(
        cache_len,
        anc,
        num_queries=anc.shape[1],
        cache_size=longest,
        num_tree_keys=num_tree_keys,
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
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of tree queries over [committed cache | tree keys].

    Args:
        q: [B, Hq, M, D] queries of the M new nodes.
        k_cache, v_cache: [B, Hkv, S, D] committed cache (only [0, cache_len) is read).
        cache_len: [B] int, committed length per slot.
        k_tree, v_tree: [B, Hkv, N, D] tree keys/values (side buffer + new nodes).
        anc: [B, M, W] int64 ancestor bitmask over the N tree keys.
        scale: softmax scale, usually head_dim ** -0.5.
        mask: [B, 1, M, S' + N] bool from `host_attention_mask`, shared by the layers of an
            eager CPU forward (the cache is then read up to S'); None builds the whole mask
            here, the form the compiler pass recognises.
    Returns:
        [B, Hq, M, D] in q's dtype.
    """
    if mask is None:
        mask = attention_mask(
            cache_len,
            anc,
            num_queries=q.shape[2],
            cache_size=k_cache.shape[2],
            num_tree_keys=k_tree.shape[2],
        )
    else:
        cache_size = mask.shape[-1] - k_tree.shape[2]
        k = torch.cat([k_cache[:, :, :cache_size], k_tree], dim=2)
        v = torch.cat([v_cache[:, :, :cache_size], v_tree], dim=2)
        return _grouped_query_attention(q, k, v, mask, scale=scale)
    k = torch.cat([k_cache, k_tree], dim=2)
    v = torch.cat([v_cache, v_tree], dim=2)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _grouped_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """SDPA of q [B, Hq, M, D] over k, v [B, Hkv, S, D] with mask [B, 1, M, S], the query
    heads that share a key/value head stacked as that head's queries ([B, Hkv, G * M, D]).
    The CPU's SDPA runs one small product per (head, query block): at a decode step's single
    query, `enable_gqa` over 9 query heads took 4x the time of 3 heads of 3 queries
    (SmolLM2 shapes, bf16, 300 keys: 121 against 29 us a layer)."""
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    stacked = q.reshape(batch, num_kv_heads, group * num_queries, head_dim)
    # A view at one query (the broadcast row needs no copy), a small copy for a tree's M.
    stacked_mask = mask[:, :, None].expand(batch, 1, group, num_queries, num_keys)
    stacked_mask = stacked_mask.reshape(batch, 1, group * num_queries, num_keys)
    out = F.scaled_dot_product_attention(stacked, k, v, attn_mask=stacked_mask, scale=scale)
    return out.view(batch, num_heads, num_queries, head_dim)


def readable_on_host(tensor: torch.Tensor) -> bool:
    """Whether reading `tensor`'s values on the host is free and safe: a real CPU tensor
    run eagerly (not traced by torch.compile / torch.export, nor a fake tensor of make_fx,
    where a read would break the graph or bake the value into it). Eager CPU code may then
    skip work a compiled or captured round must do for every value."""
    return (
        tensor.device.type == "cpu"
        and type(tensor) is torch.Tensor
        and not torch.compiler.is_compiling()
    )
