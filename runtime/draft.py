"""The draft side of a round: extend the draft cache, expand the tree level by level, rerank.

Draft position convention (as EAGLE trains its heads): draft position j holds the pair
(token j+1, feature of position j), and its output predicts token j+2. So the pair
(root, feature of the last committed token) sits at the last committed draft position, and a
level-l tree node at that position + l.

Draft extend runs the head over the pairs pending from the last round (accepted tokens with
the target's features, at most D+1, padded) and commits them to the draft cache. Expansion runs
the head over the K frontier nodes of each level; their K/V live in a side buffer that later
levels attend to under a rectangular ancestor mask, and are dropped at the end of the round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.attention import (
    chain_ancestors,
    expand_ancestor_mask,
    key_bits,
    num_mask_words,
    pack_ancestor_mask,
)
from ..models.eagle import DraftHead, DraftOutput
from ..models.llama import AttentionInputs
from .kv_cache import KVCache
from .tree import (
    Candidates,
    StaticTree,
    Tree,
    TreeShape,
    ancestor_bitmask,
    expand_level,
    first_level,
    log_norm_from_top,
    rerank,
)


@dataclass
class PendingPairs:
    """Pairs the draft has not seen yet, per slot.

    tokens: [B, P] int64; features: [B, P, H] target features (already projected for EAGLE-3);
    num_valid: [B] int64 valid pairs (the rest is padding, never committed).
    """

    tokens: torch.Tensor
    features: torch.Tensor
    num_valid: torch.Tensor


@dataclass
class Frontier:
    """The K nodes of the level being expanded: tokens [B, K], features [B, K, H] (their
    parents' draft hidden states), scores [B, K], candidate indices [B, K], and anc [B, K, W]
    int64: the side-buffer slots (earlier frontier nodes) each node descends from, packed as
    an ancestor bitmask (bit s: slot s; no words before the first level)."""

    tokens: torch.Tensor
    features: torch.Tensor
    scores: torch.Tensor
    candidate: torch.Tensor
    anc: torch.Tensor


def draft_extend(
    head: DraftHead, cache: KVCache, pending: PendingPairs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit the pending pairs to the draft cache.

    Returns the root's feature [B, H] (the head's hidden state at the last valid pair) and the
    logits of the root's children [B, V_draft].
    """
    root_feature = draft_commit(head, cache, pending)
    return root_feature, head.logits(root_feature)


def draft_commit(head: DraftHead, cache: KVCache, pending: PendingPairs) -> torch.Tensor:
    """Run the head's trunk over the pending pairs (all P columns; the first `num_valid` of
    each row are committed to the draft cache). Returns the hidden state [B, H] at each row's
    last valid pair."""
    batch, num_pairs = pending.tokens.shape
    device = pending.tokens.device
    positions = cache.lengths[:, None] + torch.arange(num_pairs, device=device)
    anc = chain_ancestors(batch, num_pairs, device)
    # No side buffer: the trunk's tree keys are the pairs' own.
    hidden, k_new, v_new = head.trunk(
        pending.tokens, pending.features, positions, cache.attention_inputs(anc)
    )
    cache.append(k_new, v_new, pending.num_valid)
    last = (pending.num_valid - 1).clamp_min(0)
    return hidden[torch.arange(batch, device=device), last]


def draft_tree(
    head: DraftHead,
    cache: KVCache,
    pending: PendingPairs,
    root: torch.Tensor,
    shape: TreeShape,
) -> Tree:
    """Draft one round's tree.

    Args:
        head: the draft head.
        cache: the draft KV cache (pending pairs are committed to it).
        pending: pairs from the last round (see PendingPairs).
        root: [B] int64 the pending root token.
        shape: (D, K, N).
    """
    root_feature, root_logits = draft_extend(head, cache, pending)
    tokens, scores = first_level(root_logits, shape.topk)
    frontier, cands = first_frontier(head.to_target_ids(tokens), scores, root_feature)
    side: tuple[torch.Tensor, torch.Tensor] | None = None
    for level in range(1, shape.depth):
        frontier, side, level_cands = _expand(head, cache, frontier, side, level, shape)
        cands = cands.then(level_cands)
    tree = rerank(root, cands, shape)
    root_log_norm = log_norm_from_top(root_logits, tokens, scores)
    return dataclasses.replace(tree, root_logits=root_logits, root_log_norm=root_log_norm)


def first_frontier(
    tokens: torch.Tensor, scores: torch.Tensor, root_feature: torch.Tensor
) -> tuple[Frontier, Candidates]:
    """Level 1: the root's K children (tokens [B, K] target ids, scores [B, K]), each fed the
    root's feature [B, H], as the first frontier and the first candidates."""
    batch, topk = tokens.shape
    device = tokens.device
    candidate = torch.arange(topk, device=device).expand(batch, -1)
    frontier = Frontier(
        tokens=tokens,
        features=root_feature[:, None].expand(-1, topk, -1),
        scores=scores,
        candidate=candidate,
        anc=torch.zeros(batch, topk, 0, dtype=torch.int64, device=device),
    )
    return frontier, Candidates(tokens, scores, torch.full_like(tokens, -1))


def _expand(
    head: DraftHead,
    cache: KVCache,
    frontier: Frontier,
    side: tuple[torch.Tensor, torch.Tensor] | None,
    level: int,
    shape: TreeShape,
) -> tuple[Frontier, tuple[torch.Tensor, torch.Tensor], Candidates]:
    """Run the head on the level-`level` frontier; score its children; pick the next frontier."""
    out, visible, side = run_frontier(head, cache, frontier, side, level)
    tokens, scores, parent, chosen = expand_level(frontier.scores, out.logits, shape.topk)
    next_frontier, level_cands = next_level(
        head.to_target_ids(tokens), scores, parent, chosen,
        frontier=frontier, out=out, visible=visible, level=level, shape=shape,
    )  # fmt: skip
    return next_frontier, side, level_cands


def run_frontier(
    head: DraftHead,
    cache: KVCache,
    frontier: Frontier,
    side: tuple[torch.Tensor, torch.Tensor] | None,
    level: int,
) -> tuple[DraftOutput, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The head over the level-`level` frontier, attending to the cache, the side buffer and
    itself. Returns its output (logits [B, K, V_draft]: the frontier's children), the
    frontier's visibility [B, K, W] int64, the ancestor bitmask over the S side-buffer slots
    and the frontier's own K (slots S..S+K-1), and the side buffer grown by the frontier's K/V."""
    topk = frontier.tokens.shape[1]
    num_side = 0 if side is None else side[0].shape[3]
    visible = frontier_visibility(frontier.anc, num_side)
    attn = AttentionInputs(
        cache.k,
        cache.v,
        cache.lengths,
        visible,
        None if side is None else side[0],
        None if side is None else side[1],
    )
    positions = (cache.lengths - 1 + level)[:, None].expand(-1, topk)
    out = head(frontier.tokens, frontier.features, positions, attn)
    return out, visible, (out.k_tree, out.v_tree)


def frontier_visibility(anc: torch.Tensor, num_side: int) -> torch.Tensor:
    """What each of K frontier nodes attends to among the tree keys: its ancestors in the side
    buffer and itself. anc: [B, K, W] int64 packed ancestors over the `num_side` side-buffer
    slots (Frontier.anc). Returns [B, K, W'] int64 packed over num_side + K keys (node k is
    key num_side + k)."""
    topk = anc.shape[1]
    num_words = num_mask_words(num_side + topk)
    # Packed throughout: a node ORs its own bit into its parent's words, so no level unpacks
    # and re-packs a boolean mask (a reduction kernel a level in compiled rounds).
    words = F.pad(anc, (0, num_words - anc.shape[-1]))
    return words | key_bits(num_side + torch.arange(topk, device=anc.device), num_words)


def next_level(
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parent: torch.Tensor,
    chosen: torch.Tensor,
    *,
    frontier: Frontier,
    out: DraftOutput,
    visible: torch.Tensor,
    level: int,
    shape: TreeShape,
) -> tuple[Frontier, Candidates]:
    """The next frontier and this level's candidates, from the K*K scored children (tokens
    [B, K*K] target ids, scores, parent frontier index) and the chosen [B, K] among them."""
    offset = shape.topk + (level - 1) * shape.topk**2
    chosen_parent = parent.gather(1, chosen)
    next_frontier = Frontier(
        tokens=tokens.gather(1, chosen),
        features=_rows(out.hidden, chosen_parent),
        scores=scores.gather(1, chosen),
        candidate=offset + chosen,
        anc=_rows(visible, chosen_parent),
    )
    return next_frontier, Candidates(tokens, scores, frontier.candidate.gather(1, parent))


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [B, K, F], index: [B, J] -> [B, J, F] (row gather per slot)."""
    return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))


def draft_static_tree(
    head: DraftHead,
    cache: KVCache,
    pending: PendingPairs,
    root: torch.Tensor,
    static: StaticTree,
) -> Tree:
    """Draft a fixed tree: each node takes its parent's rank-r draft token.

    Levels are drafted in turn; every node of a level below D is run through the head (its K/V
    joins the side buffer) so that its children can be read off its draft distribution.
    """
    root_feature, root_logits = draft_extend(head, cache, pending)
    batch, device = root.shape[0], root.device
    parents, depths = static.parent_nodes(), [0] + [len(p) for p in static.paths]
    ranks = [0] + [p[-1] for p in static.paths]
    visible = expand_ancestor_mask(_static_ancestors(static, device), static.num_nodes)
    top = head.to_target_ids(root_logits.topk(static.max_rank, dim=-1).indices)
    tokens = [root] + [top[:, ranks[n]] for n in range(1, static.num_nodes) if depths[n] == 1]
    features = {n: root_feature for n in range(1, static.num_nodes) if depths[n] == 1}
    side: tuple[torch.Tensor, torch.Tensor] | None = None
    for level in range(1, static.depth):
        nodes = [n for n in range(1, static.num_nodes) if depths[n] == level]
        # Side-buffer slot s holds node s + 1: levels are drafted in node order.
        anc = pack_ancestor_mask(visible[nodes][:, 1 : nodes[-1] + 1]).expand(batch, -1, -1)
        attn = AttentionInputs(
            cache.k, cache.v, cache.lengths, anc, *(side if side is not None else (None, None))
        )
        positions = (cache.lengths - 1 + level)[:, None].expand(-1, len(nodes))
        node_tokens = torch.stack([tokens[n] for n in nodes], dim=1)
        node_features = torch.stack([features[n] for n in nodes], dim=1)
        out = head(node_tokens, node_features, positions, attn)
        side = (out.k_tree, out.v_tree)
        top = head.to_target_ids(out.logits.topk(static.max_rank, dim=-1).indices)
        for child in range(1, static.num_nodes):
            if depths[child] == level + 1:
                j = nodes.index(parents[child])
                tokens.append(top[:, j, ranks[child]])
                features[child] = out.hidden[:, j]
    parent = torch.tensor(parents, device=device).expand(batch, -1)
    return Tree(
        tokens=torch.stack(tokens, dim=1),
        parent=parent,
        depth=torch.tensor(depths, device=device).expand(batch, -1),
        anc=_static_ancestors(static, device).expand(batch, -1, -1),
        root_logits=root_logits,
    )


def _static_ancestors(static: StaticTree, device: torch.device) -> torch.Tensor:
    """[N, W] int64 ancestor bitmask of a static tree (root = node 0)."""
    parent = torch.tensor(static.parent_nodes(), device=device)[None]
    return ancestor_bitmask(parent, max_depth=static.depth)[0]
