"""What every speculation policy shares: a candidate round, the ladder of tree shapes a bucket
chooses among (`tree_ladder`), the `Policy` interface, and helpers over candidates."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar, Protocol

from ..acceptance import AcceptanceEstimate, RoundCosts
from ..tree import StaticTree, TreeShape


class Candidate(Protocol, Hashable):
    """A round a bucket can run: its tree (None: plain decoding)."""

    tree: TreeShape | StaticTree | None


def tree_ladder(tree: TreeShape | StaticTree | None) -> tuple[TreeShape | StaticTree | None, ...]:
    """The shapes an adaptive policy chooses among for a bucket configured with `tree`: the
    tree, then, largest first, one of about half its depth and width with a third of its
    nodes and a small (3, 2, 4) tree (both no larger than it), and plain decoding (None)."""
    if tree is None:
        return (None,)
    if isinstance(tree, StaticTree):
        return (tree, None)
    half_depth, half_topk = -(-tree.depth // 2), -(-tree.topk // 2)
    most_nodes = 1 + half_topk + (half_depth - 1) * half_topk**2
    half_nodes = min(max(half_depth + 1, tree.num_nodes // 3), most_nodes)
    half = TreeShape(half_depth, half_topk, half_nodes, tree.stochastic)
    small_depth = min(3, tree.depth)
    small = TreeShape(small_depth, min(2, tree.topk), small_depth + 1, tree.stochastic)
    smaller = sorted({half, small} - {tree}, key=lambda t: (t.num_nodes, t.depth), reverse=True)
    return (tree, *smaller, None)


class Policy:
    """Chooses one of a bucket's candidates before each round (`choose`) and hears every
    round's accepted drafts per live row (`observe`)."""

    name: ClassVar[str]
    # Whether drafts_new may return False.
    skips_drafts: ClassVar[bool] = False

    def choose(
        self,
        bucket: int,
        candidates: Sequence[Candidate],
        requests: Sequence[AcceptanceEstimate],
        costs: RoundCosts,
    ) -> Candidate:
        raise NotImplementedError

    def observe(self, bucket: int, candidate: Candidate, accepted: Sequence[int]) -> None:
        """One round's accepted draft tokens of its live rows."""

    def leaves_draft_behind(self, bucket: int) -> bool:
        """Whether the plain round just chosen for the bucket may leave the live requests'
        drafts behind for good (RoundPlanner.plan then runs a bare plain step)."""
        return False

    def explored(self, bucket: int) -> bool:
        """Whether the round just chosen for the bucket is an exploring one: run to keep the
        acceptance estimates current, not because it was expected to be the fastest."""
        return False

    def drafts_new(
        self,
        bucket: int,
        candidates: Sequence[Candidate],
        requests: Sequence[AcceptanceEstimate],
        costs: RoundCosts,
    ) -> bool:
        """Whether new requests joining the bucket are prefilled with the head (False:
        their drafts are left behind from the start; RoundPlanner.drafts_prompts)."""
        return True

    @property
    def adaptive(self) -> bool:
        """Whether the policy chooses among several shapes (False: only the first is built)."""
        return True


def speculative_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates that draft a tree."""
    return [c for c in candidates if c.tree is not None]


def plain_or_first(candidates: Sequence[Candidate]) -> Candidate:
    return next((c for c in candidates if c.tree is None), candidates[0])


def nearest_depth(candidates: Sequence[Candidate], depth: float, *, above: bool) -> Candidate:
    """The candidate whose depth is nearest `depth`; with `above`, the shallowest at least
    that deep (else the deepest)."""
    if above:
        deep_enough = [c for c in candidates if c.tree.depth >= depth]
        if deep_enough:
            return min(deep_enough, key=lambda c: c.tree.depth)
        return max(candidates, key=lambda c: c.tree.depth)
    return min(candidates, key=lambda c: (abs(c.tree.depth - depth), c.tree.depth))
