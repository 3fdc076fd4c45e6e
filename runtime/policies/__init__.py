"""Speculation policies: before each round, which of the bucket's captured tree shapes (plain
decoding included) the batch runs.

Each bucket has a ladder of candidate shapes (`tree_ladder`): its configured tree, a tree of
half its depth and width, a small tree, and plain decoding. Every candidate is a whole round
compiled (and on CUDA captured) for the bucket, so switching costs nothing; the Decoder keeps
the draft cache in step through plain rounds, so any round may speculate again (until a
policy lets the drafts fall behind for good, `Policy.leaves_draft_behind`).

Policies, by `EngineConfig.policy` name:
- `fixed`: the configured tree, every round (no other shape is built).
- `cost` (the default): the shape that maximises expected tokens per second, the sum over
  live requests of (1 + expected accepted drafts) divided by the round's measured seconds
  (runtime/acceptance.py); a shape not yet measured runs first.
  While no request waits for a slot, nothing refills the slots of requests that end, so the
  batch takes as long as its slowest request: the shape that minimises the time until the
  last request ends. Under a shape, each request ends after remaining tokens / (1 + expected
  accepted drafts) rounds; the batch pays this bucket's cost until few enough are left to
  run in a smaller bucket, then that bucket's (the shape's cost scaled as the plain step's
  is between the buckets). So a tree that the slowest request alone would not pay for still
  runs when it ends the others early enough that the slowest finishes in a cheaper bucket.
  Where a tree costs twice a plain step, overrating the slowest request costs more than
  underrating it: a lower quartile of the requests instead kept trees running at batch 16
  that the slowest request did not pay for. A request that has not yet
  run a few speculative rounds is expected to accept no more than the slowest of a batch
  of its size that its kind's finished requests make likely (`AcceptanceBook.slowest_of`):
  the kind's mean says little about a batch's slowest request.
  The expectation for a sampled (stochastic) tree is calibrated by what that tree's rounds
  accepted against what was expected of them (a moving ratio: the model extrapolates one
  chain acceptance to every tree, and sampled children, drawn with repeats, accept less
  than it predicts for wide levels).
  Hysteresis: the current shape stays unless another beats it by `HYSTERESIS`; from a
  tree, plain decoding must also beat the best tree by `PLAIN_HYSTERESIS` while some
  request has run speculative rounds of its own (wider: plain rounds teach the estimates
  nothing, so a move to plain decoding on a dip in acceptance lasts until drift brings the
  estimates back, while a smaller tree keeps measuring; a new static batch's requests hold
  only their kind's running mean, which does not dip), and must win at the requests'
  settled acceptance too (`AcceptanceEstimate.settled_alpha`: the request's whole text so
  far against its kind's mean counted as SETTLED_PRIOR_ROUNDS rounds). A dip in a text
  that drafts well as a whole does not end its trees; a request that drafts poorly
  throughout still goes plain once its own rounds outweigh its kind's mean.
  While plain decoding wins, the smallest tree runs now and then so that acceptance
  estimates stay current: each plain round earns `EXPLORE_SHARE` of its seconds, and an
  exploring round runs when the earnings cover what it costs over a plain round (so
  exploring costs at most that share of the time; every `EXPLORE_EVERY` rounds until both
  rounds are measured).
  When no tree beats plain decoding by `IN_STEP_COST` (what keeping the drafts in step adds
  to a plain round) even for requests that accept what their kind accepts on average (the
  engine's running mean, not one request's recent rounds, which dip and recover with the
  text; in a static batch, new requests capped at their kind's likely slowest as above), the
  policy lets the live requests' drafts fall behind for good (`leaves_draft_behind`): the
  planner then runs bare plain steps, which neither append to nor commit the pending pairs,
  so plain decoding costs what it costs without a head. Requests that have not yet run a
  tree take the exploring rounds the budget allows first, so the running means keep
  learning; for a kind left behind, that budget shrinks with the share of its explored new
  requests that turned out worth a tree (at their own estimate after the round), so a kind
  that never pays stops paying for exploring too; the plain rounds of requests already left
  behind save for the next new request at that shrunken share as well. New requests of such
  a kind are prefilled without the head, their drafts behind from the start (`drafts_new`),
  but for one in as many as that share says: a trial, run with the head, so the kind can
  still recover.
- `batch-table`: the configured tree (a batch-size schedule) until the mean accepted drafts
  per request-round over the last `WINDOW` falls below `CUTOFF`, then plain decoding for
  good (TensorRT-LLM's rule; vLLM's table without the cut-off).
- `ema`: a moving average of the batch's accepted drafts picks the shallowest tree at least
  one level deeper (SGLang's rule, over trees instead of chains); never plain.
- `gammatune`: a target depth that grows by one after a round whose rows all accepted every
  level, and otherwise falls halfway to what was accepted; the tree nearest it; never plain.
- `dsde`: each request's speculation length from the KL divergence between draft and target
  the rounds report and its variance (`dsde_length`, DSDE's signal); the tree whose depth is
  nearest the batch's mean length, plain decoding below DSDE_PLAIN_BELOW (exploring as
  `cost` does).

Modules: base.py (the candidate, the ladder, the `Policy` interface), cost.py (`cost`,
`dsde` and their exploring rounds), rules.py (`fixed`, `batch-table`, `ema`, `gammatune`).
"""

from __future__ import annotations

from .base import Candidate, Policy, tree_ladder
from .cost import CostPolicy, DsdePolicy, dsde_length
from .rules import BatchTablePolicy, EmaPolicy, FixedPolicy, GammaTunePolicy

__all__ = [
    "POLICIES",
    "BatchTablePolicy",
    "Candidate",
    "CostPolicy",
    "DsdePolicy",
    "EmaPolicy",
    "FixedPolicy",
    "GammaTunePolicy",
    "Policy",
    "dsde_length",
    "make_policy",
    "tree_ladder",
]

POLICIES: dict[str, type[Policy]] = {
    policy.name: policy
    for policy in (
        CostPolicy,
        FixedPolicy,
        BatchTablePolicy,
        EmaPolicy,
        GammaTunePolicy,
        DsdePolicy,
    )
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name (config.POLICY_NAMES)."""
    if name not in POLICIES:
        raise ValueError(f"unknown speculation policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
