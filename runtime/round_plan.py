"""Which round a batch runs next: the rounds each bucket may run (`RoundVariant`: a tree of the
bucket's ladder or plain decoding, for the requests' sampling parameters), and the choice
among them before each launch by the speculation policy (runtime/policies/) from the round
costs and the requests' acceptance estimates (runtime/acceptance.py).

The Decoder owns one `RoundPlanner` (`Decoder.planner`), compiles and captures every round
`variants` lists, and runs what `plan` returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .acceptance import AcceptanceBook, AcceptanceEstimate, MeasuredAcceptance, RoundCosts
from .config import EngineConfig, SamplingParams
from .policies import make_policy, tree_ladder
from .sampling import needs_filtering
from .tree import StaticTree, TreeShape


@dataclass(frozen=True)
class RoundVariant:
    """One of a bucket's rounds: each is compiled (and on CUDA captured) on its own; the
    policy picks the tree among the bucket's shapes and the requests' parameters the rest
    (`RoundPlanner.plan`).

    tree: the tree drafted and verified (None: plain decoding). A stochastic TreeShape only
        when some request samples: a batch of greedy requests runs it as its top-k tree, which
        greedy rows draft and walk anyway, without the sampled draft and the rejection walk.
    filtered: some request samples with top-k / top-p (see SamplingTensors.filtered).
    num_pending: a plain round of a decoder that speculates that first commits the pending
        pairs to the draft cache (round.synced_decode_round): the pending width. 0 otherwise.
    appends: a plain round of a decoder that speculates that leaves the draft cache behind:
        its (token, root feature) pair joins the pending ones, for a later round to commit
        (round.appending_decode_round). It costs what a plain step costs; the planner runs
        it while every slot's pending pairs have room (`RoundPlanner.plan`).
    greedy: no request samples: the top-k form of a stochastic shape, which only greedy
        batches run, so its target draws take the argmax and draw no noise
        (SamplingTensors.greedy).
    """

    tree: TreeShape | StaticTree | None = None
    filtered: bool = False
    num_pending: int = 0
    appends: bool = False
    greedy: bool = False

    @property
    def stochastic(self) -> bool:
        """Whether sampling rows draft by sampling and walk by rejection."""
        return isinstance(self.tree, TreeShape) and self.tree.stochastic

    @property
    def bare(self) -> bool:
        """A plain round that neither appends nor commits pending pairs: in a decoder that
        speculates, one that leaves the drafts behind."""
        return self.tree is None and not self.appends and not self.num_pending

    @property
    def cost_key(self) -> RoundVariant:
        """The variant whose cost this round shares: plain rounds are one, however they treat
        the pending pairs (the average over them is what plain decoding costs)."""
        return dataclasses.replace(self, num_pending=0, appends=False)

    @property
    def tag(self) -> str:
        """A short name for tables, logs and metrics: the tree ("plain", "D,K,N" or
        "staticN"), then "f" if filtered and "s" if stochastic."""
        return tree_label(self.tree) + "f" * self.filtered + "s" * self.stochastic


def tree_label(tree: TreeShape | StaticTree | None) -> str:
    """ "plain", "D,K,N" for a TreeShape, "staticN" for a StaticTree of N nodes."""
    if tree is None:
        return "plain"
    if isinstance(tree, StaticTree):
        return f"static{tree.num_nodes}"
    return f"{tree.depth},{tree.topk},{tree.num_nodes}"


class RoundPlanner:
    """The rounds of every bucket and the choice among them.

    Args:
        config: buckets, tree table and policy name.
        has_head: whether there is a draft head (without one, every round is plain).
    """

    def __init__(self, config: EngineConfig, *, has_head: bool) -> None:
        self.config = config
        self._has_head = has_head
        self.policy = make_policy(config.policy)
        self.costs = RoundCosts()
        # What the head was measured to accept (Engine sets it from the head's trees.json).
        self.measured: MeasuredAcceptance | None = None
        self._shapes = {bucket: self._ladder(bucket) for bucket in config.buckets}
        self.speculates = any(t is not None for shapes in self._shapes.values() for t in shapes)
        # Pending pairs are as wide as the deepest tree of any bucket: a slot that moves into
        # a shallower bucket may hold more pairs than that bucket's round produces.
        self.max_depth = max(map(self.depth_for, config.buckets))
        self.pending_width = self.max_depth + 1
        # The most pending pairs any slot may hold after the rounds launched so far (a
        # prefill leaves 1, so admissions never raise it).
        self._max_pending = 1
        # Whether the round `plan` chose last is an exploring one (Policy.explored).
        self.explored = False

    def new_book(self) -> AcceptanceBook:
        """The acceptance estimates of a run of requests, starting from what the head was
        measured to accept."""
        return AcceptanceBook.starting_from(self.measured)

    @property
    def num_shapes(self) -> int:
        """The shapes of all buckets together."""
        return sum(len(shapes) for shapes in self._shapes.values())

    def tree_for(self, bucket: int) -> TreeShape | StaticTree | None:
        """The bucket's configured draft tree (None: plain decoding)."""
        return self.config.tree_for(bucket) if self._has_head else None

    def shapes(self, bucket: int) -> tuple[TreeShape | StaticTree | None, ...]:
        """The trees the bucket's rounds may run, its configured one first (policy.tree_ladder
        for an adaptive policy; None: plain decoding)."""
        return self._shapes[bucket]

    def _ladder(self, bucket: int) -> tuple[TreeShape | StaticTree | None, ...]:
        tree = self.tree_for(bucket)
        return tree_ladder(tree) if self.policy.adaptive else (tree,)

    def is_stochastic(self, bucket: int) -> bool:
        """Whether the bucket's configured tree is stochastic for requests that sample."""
        tree = self.tree_for(bucket)
        return isinstance(tree, TreeShape) and tree.stochastic

    def depth_for(self, bucket: int) -> int:
        """The deepest tree the bucket's rounds may run (0: plain decoding only)."""
        return max((tree.depth for tree in self.shapes(bucket) if tree is not None), default=0)

    def candidates(self, bucket: int, params: Sequence[SamplingParams]) -> list[RoundVariant]:
        """The rounds a batch of these requests may run in the bucket, one per shape."""
        samples = any(not p.greedy for p in params)
        filtered = needs_filtering(params)
        return [
            _variant_for_sampling(tree, samples=samples, filtered=filtered)
            for tree in self.shapes(bucket)
        ]

    def variant_for(self, bucket: int, params: Sequence[SamplingParams]) -> RoundVariant:
        """The round a batch of these requests runs in the bucket with its configured tree."""
        return self.candidates(bucket, params)[0]

    def launchable(self, bucket: int, params: Sequence[SamplingParams]) -> list[RoundVariant]:
        """Every round `plan` may launch in the bucket for these requests (plain rounds that
        append to the pending pairs, that commit them, and, for an adaptive policy, that leave them
        alone)."""
        found = []
        for variant in self.candidates(bucket, params):
            if variant.tree is None and self.speculates:
                found.append(dataclasses.replace(variant, appends=True))
                found.append(dataclasses.replace(variant, num_pending=self.pending_width))
                if self.policy.adaptive:
                    found.append(variant)
            else:
                found.append(variant)
        return found

    def variants(self, bucket: int, *, filtered: bool = False) -> list[RoundVariant]:
        """Every round the bucket may run for greedy and plainly sampling requests, and with
        `filtered` for top-k / top-p ones too (`launchable` for each kind)."""
        kinds = [SamplingParams(), SamplingParams(temperature=1.0)]
        if filtered:
            kinds.append(SamplingParams(temperature=1.0, top_k=1))
        found = [v for params in kinds for v in self.launchable(bucket, [params])]
        return list(dict.fromkeys(found))

    def plan(
        self,
        bucket: int,
        params: Sequence[SamplingParams],
        estimates: Sequence[AcceptanceEstimate],
    ) -> RoundVariant:
        """The round to launch next in the bucket for live requests with these parameters and
        acceptance estimates: the policy's choice among `candidates`. A plain one appends its
        pair to the pending ones while they have room in every slot, and commits them to the
        draft cache when they may not, so the draft falls at most a pending width behind;
        unless the policy lets the drafts fall behind for good, or they already have (no
        estimate `in_step`): then it is a bare plain step, and it marks every estimate out
        of step (a tree round stays lossless for such a request, its drafts just go
        unaccepted). Call it for every round launched, in launch order; each estimate still
        in step counts the round as launched in step (`num_in_step_in_flight`), so what it
        accepts is learnt from even when it is read after a later plan left the draft
        behind (the host plans ahead of the rounds it reads on CUDA)."""
        chosen = self._choose(bucket, params, estimates)
        for estimate in estimates:
            estimate.num_in_step_in_flight += estimate.in_step
        return chosen

    @property
    def skips_drafts(self) -> bool:
        """Whether `drafts_prompts` may return False (the policy may decline to draft)."""
        return self.speculates and self.policy.skips_drafts

    def drafts_prompts(
        self,
        bucket: int,
        params: Sequence[SamplingParams],
        estimates: Sequence[AcceptanceEstimate],
    ) -> bool:
        """Whether new requests with these parameters and fresh estimates, joining the
        bucket, are prefilled with the head: the policy's `drafts_new`. When they are not,
        their estimates are marked out of step, as a plain round leaving their drafts
        behind would have marked them."""
        if not self.speculates:
            return True
        drafted = self.policy.drafts_new(
            bucket, self.candidates(bucket, params), estimates, self.costs
        )
        if not drafted:
            for estimate in estimates:
                estimate.in_step = False
        return drafted

    def _choose(
        self,
        bucket: int,
        params: Sequence[SamplingParams],
        estimates: Sequence[AcceptanceEstimate],
    ) -> RoundVariant:
        found = self.candidates(bucket, params)
        chosen = (
            found[0]
            if len(found) == 1
            else self.policy.choose(bucket, found, estimates, self.costs)
        )
        self.explored = len(found) > 1 and self.policy.explored(bucket)
        if chosen.tree is None and self.speculates and self._left_behind(bucket, estimates):
            for estimate in estimates:
                estimate.in_step = False
            return chosen
        if chosen.tree is not None:
            self._max_pending = chosen.tree.depth + 1
        elif self.speculates and self._max_pending < self.pending_width:
            chosen = dataclasses.replace(chosen, appends=True)
            self._max_pending += 1
        elif self.speculates:
            chosen = dataclasses.replace(chosen, num_pending=self.pending_width)
            self._max_pending = 1
        return chosen

    def _left_behind(self, bucket: int, estimates: Sequence[AcceptanceEstimate]) -> bool:
        """Whether a plain round now leaves the drafts behind: the policy says so, or none
        of the live requests is in step any more."""
        if not self.policy.adaptive:
            return False
        return self.policy.leaves_draft_behind(bucket) or not any(e.in_step for e in estimates)

    def done(
        self, bucket: int, variant: RoundVariant, seconds: float, accepted: Sequence[int]
    ) -> None:
        """Tell the cost table and the policy about a round read back: its seconds and its
        live rows' accepted draft tokens."""
        self.costs.observe(bucket, variant.cost_key, seconds)
        self.policy.observe(bucket, variant.cost_key, accepted)


def _for_sampling(
    tree: TreeShape | StaticTree | None, samples: bool
) -> TreeShape | StaticTree | None:
    """The tree a batch runs: a stochastic shape as its top-k tree when nobody samples."""
    if isinstance(tree, TreeShape) and tree.stochastic and not samples:
        return dataclasses.replace(tree, stochastic=False)
    return tree


def _variant_for_sampling(
    tree: TreeShape | StaticTree | None, *, samples: bool, filtered: bool
) -> RoundVariant:
    """The round a batch runs with `tree`: a stochastic shape's top-k form, when nobody
    samples, draws greedily (RoundVariant.greedy)."""
    runs = _for_sampling(tree, samples)
    return RoundVariant(tree=runs, filtered=filtered, greedy=runs is not tree)
