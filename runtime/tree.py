"""Draft-tree construction with static shapes: EAGLE-2 expansion + global rerank, static trees.

The tree of one round: node 0 is the root (the pending token), nodes 1..N-1 are draft tokens.
Drafting proceeds level by level. Level 1 holds the K best children of the root; each later
level scores the K*K children of the K frontier nodes by cumulative draft log-probability and
keeps the top K as the next frontier. Every scored child is a candidate; the rerank keeps the
N-1 best candidates over all levels. A child never outscores its parent (log-probs are <= 0,
and ties go to the earlier candidate), so the kept set is closed under ancestors.

Candidates are numbered level by level: level 1 is [0, K), level l >= 2 is
[K + (l-2) K^2, K + (l-1) K^2). Shapes depend only on (D, K, N), never on values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.attention import pack_ancestor_mask
from .kernels.topk import MAX_K, log_softmax_topk, topk


@dataclass(frozen=True)
class TreeShape:
    """depth: levels below the root (D); topk: frontier width (K); num_nodes: N, root included.

    stochastic: requests that sample (temperature > 0) draft their trees by sampling from the
    head without replacement and verify them by recursive rejection sampling (runtime/draft.py,
    runtime/verify.py), instead of drafting the head's top-k; greedy requests are unchanged.
    """

    depth: int
    topk: int
    num_nodes: int
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"tree stochastic must be a bool, got {self.stochastic!r}")
        for name in ("depth", "topk", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree {name} must be a positive int, got {value!r}")
        if self.num_nodes - 1 > self.num_candidates:
            raise ValueError(
                f"tree num_nodes={self.num_nodes} needs more than the {self.num_candidates} "
                f"candidates that depth={self.depth}, topk={self.topk} produce; lower num_nodes "
                "or raise depth/topk"
            )

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk**2


@dataclass
class Tree:
    """One round's tree per slot (node 0 = root).

    tokens: [B, N] int64 (tokens[:, 0] is the root token).
    parent: [B, N] int64 node index of the parent (the root is its own parent).
    depth: [B, N] int64 (root 0).
    anc: [B, N, W] int64 ancestor bitmask (bit j of node i set iff j is i or an ancestor of i).
    root_logits: [B, V_draft] the head's logits for the root's children (what the round's
        acceptance signals compare with the target's), once drafted.
    root_log_norm: [B] float32 log-sum-exp of root_logits where the draft computed it anyway
        (the top-k tree's first level), else None.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    anc: torch.Tensor
    root_logits: torch.Tensor | None = None
    root_log_norm: torch.Tensor | None = None


@dataclass
class Candidates:
    """Everything scored while drafting, in candidate order (see module docstring).

    tokens: [B, C] int64; scores: [B, C] float32 cumulative log-probs;
    parent: [B, C] int64 candidate index of the parent (-1 for children of the root).
    """

    tokens: torch.Tensor
    scores: torch.Tensor
    parent: torch.Tensor

    def then(self, level: Candidates) -> Candidates:
        """These candidates followed by the next level's."""
        return Candidates(
            torch.cat([self.tokens, level.tokens], 1),
            torch.cat([self.scores, level.scores], 1),
            torch.cat([self.parent, level.parent], 1),
        )


def first_level(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K best children of the root.

    Args:
        logits: [B, V] draft logits for the root's next token (any float dtype).
    Returns:
        tokens [B, K] int64 and their scores [B, K] float32 log-probabilities (best first).
    """
    scores, tokens = log_softmax_topk(logits, topk)
    return tokens, scores


def log_norm_from_top(
    logits: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """[B] float32 log-sum-exp of logits [B, V], recovered from `first_level`'s best child
    (tokens, scores [B, K]): its logit minus its log-probability, so that no second reduction
    over the vocabulary runs (equal to a fresh logsumexp up to float32 rounding)."""
    return logits.gather(-1, tokens[:, :1]).float().squeeze(-1) - scores[:, 0]


def expand_level(
    frontier_scores: torch.Tensor, logits: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score the K*K children of the K frontier nodes and pick the next frontier.

    Args:
        frontier_scores: [B, K] float32 cumulative scores of the frontier.
        logits: [B, K, V] draft logits of each frontier node's children (any float dtype).
    Returns:
        tokens [B, K*K], scores [B, K*K] (child j of frontier node f at f*K + j),
        parent [B, K*K] frontier index of each child, and next_frontier [B, K]: indices into
        the K*K children of the new frontier, best first.
    """
    child_logp, tokens = log_softmax_topk(logits, topk)
    return choose_frontier(tokens, child_scores(frontier_scores[..., None], child_logp))


def child_scores(parent_scores: torch.Tensor, child_logp: torch.Tensor) -> torch.Tensor:
    """Cumulative scores of children: parent's plus the child's log-probability, never above
    the parent's (rounding aside, log-probs are <= 0; this keeps kept sets ancestor-closed)."""
    return torch.minimum(parent_scores + child_logp, parent_scores)


def choose_frontier(
    tokens: torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K children of each of K frontier nodes (tokens, scores [B, K, K]) as one level:
    flattened (child j of node f at f*K + j), each one's parent frontier index, and the next
    frontier [B, K] (the best K, ties to the lower index). See `expand_level`."""
    batch, topk = tokens.shape[:2]
    scores, tokens = scores.reshape(batch, -1), tokens.reshape(batch, -1)
    parent = torch.arange(topk, device=tokens.device).repeat_interleave(topk).expand(batch, -1)
    return tokens, scores, parent, stable_topk(scores, topk)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the k largest scores per row; ties go to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def candidate_levels(shape: TreeShape, device: torch.device | str) -> torch.Tensor:
    """[C] int64: the tree level (1..D) of every candidate index."""
    # Level 1 has K candidates, every later level K * K. Arithmetic rather than
    # repeat_interleave with tensor repeats, whose output size would need a host sync.
    index = torch.arange(shape.num_candidates, device=device)
    return torch.where(index < shape.topk, 1, 2 + (index - shape.topk) // shape.topk**2)


def rerank(root: torch.Tensor, cands: Candidates, shape: TreeShape) -> Tree:
    """Keep the N-1 best candidates (closed under ancestors) and lay them out as a tree.

    Nodes are ordered by candidate index, so parents precede children and node order within a
    level follows the draft's ranking.

    Args:
        root: [B] int64 root tokens.
        cands: all candidates of the round.
    """
    return layout_tree(root, cands, shape, kept_candidates(cands.scores, shape))


def kept_candidates(scores: torch.Tensor, shape: TreeShape) -> torch.Tensor:
    """[B, N-1] int64: the candidates (of scores [B, C]) the tree keeps, in candidate order."""
    num_kept = shape.num_nodes - 1
    # rt::topk orders as the stable sort does (ties to the lower index) in one launch, where
    # a compiled sort of every candidate is a bitonic network over them all.
    if 1 <= num_kept <= MAX_K and scores.dtype == torch.float32:
        return topk(scores, num_kept)[1].sort(dim=-1).values
    return stable_topk(scores, num_kept).sort(dim=-1).values


def layout_tree(
    root: torch.Tensor, cands: Candidates, shape: TreeShape, kept: torch.Tensor
) -> Tree:
    """The tree of the `kept` [B, N-1] candidates (closed under ancestors, in candidate order)."""
    batch, num_candidates = cands.scores.shape
    device = cands.scores.device
    node_of_candidate = torch.zeros(batch, num_candidates + 1, dtype=torch.int64, device=device)
    node_ids = torch.arange(1, shape.num_nodes, device=device).expand(batch, -1)
    # Slot 0 of node_of_candidate stands for the root (candidate -1 after the +1 shift).
    node_of_candidate.scatter_(1, kept + 1, node_ids)
    parent_candidate = cands.parent.gather(1, kept)
    parent = node_of_candidate.gather(1, parent_candidate + 1)
    root_column = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    parent = torch.cat([root_column, parent], dim=1)
    levels = candidate_levels(shape, device)[kept]
    return Tree(
        tokens=torch.cat([root[:, None], cands.tokens.gather(1, kept)], dim=1),
        parent=parent,
        depth=torch.cat([root_column, levels], dim=1),
        anc=ancestor_bitmask(parent, max_depth=shape.depth),
    )


def ancestor_bitmask(parent: torch.Tensor, *, max_depth: int) -> torch.Tensor:
    """[B, N, W] int64 ancestor-or-self bitmask from parent pointers [B, N] (root = 0 = its own
    parent), by max_depth steps of pointer chasing."""
    batch, num_nodes = parent.shape
    current = torch.arange(num_nodes, device=parent.device).expand(batch, -1)
    mask = torch.nn.functional.one_hot(current, num_nodes).bool()
    for _ in range(max_depth):
        current = parent.gather(1, current)
        mask |= torch.nn.functional.one_hot(current, num_nodes).bool()
    return pack_ancestor_mask(mask)


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree (Medusa / EAGLE-1 style) given as paths of child ranks.

    paths: each path lists, from the root down, the rank of the child taken at each level
    (0 = the draft's best); every prefix of a path must itself be a path.
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        paths = tuple(tuple(p) for p in self.paths)
        object.__setattr__(self, "paths", tuple(sorted(set(paths), key=lambda p: (len(p), p))))
        known = set(self.paths)
        for path in self.paths:
            if not path or min(path) < 0:
                raise ValueError(f"static tree path {path} must be non-empty ranks >= 0")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"static tree path {path} lacks its prefix {path[:-1]}")

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> StaticTree:
        return cls(tuple(tuple(p) for p in paths))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    @property
    def max_rank(self) -> int:
        return max(max(p) for p in self.paths) + 1

    def level(self, level: int) -> list[tuple[int, ...]]:
        """The paths ending at `level` (1-based), in node order."""
        return [p for p in self.paths if len(p) == level]

    def parent_nodes(self) -> list[int]:
        """Node index of each node's parent, root included (node 0, its own parent)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [0] + [index.get(p[:-1], 0) for p in self.paths]
