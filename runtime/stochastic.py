"""Stochastic draft trees: sampled drafts verified by recursive rejection sampling.

A deterministic tree (the head's top-k, runtime/draft.py) can accept at most the target's
probability mass on its paths, which at temperature 1 is small for a flat target. Here rows
that sample draft their children *by sampling from the head* and the verifier accepts them by
recursive rejection sampling (RRS) without replacement, which is exact for any draft
distribution; greedy rows in the same batch keep the deterministic tree and the greedy walk,
and so do seeded sampling rows, walking the target's keyed draws as with a top-k tree: what a
rejection walk accepts depends on the tree drafted, which depends on the batch's bucket and
the speculation policy, while a seeded request must sample the same tokens in any batch.

Drafting (stochastic beam search, Kool et al. 2019). A node v with draft distribution
q_v = softmax(logits / T) takes as children the Gumbel-top-K of log q_v: the first K of a
sequence of draws from q_v without replacement, in draw order. Each child's score is its
Gumbel-perturbed cumulative log-probability conditioned to be at most its parent's score (the
first child's equals it). Frontier and rerank then run unchanged on those scores.

Why verification stays exact (the conditions RRS needs at every node it visits):
- the kept children of v are a prefix of v's draw sequence: scores fall along it, and a
  node's descendants never outrank it (conditioning; ties go to the lower candidate index);
- whether child i is kept depends on its score and on nodes scoring above it, never on its
  identity: in the Gumbel process the i-th draw's identity is independent of its perturbed
  value given the draws before it, and no node scoring above child i descends from it;
- so, given the path and the earlier siblings, child i is a draw from q_v without them.
At v the verifier tries the kept children in order: accept child x with probability
min(1, r(x) / q(x)), where r starts as the target distribution p_v and q as q_v; on rejection
r <- normalise(max(r - q, 0)) and x leaves q. If no child is accepted, the bonus token is drawn
from r. The emitted token is then distributed as p_v exactly (the classic speculative-sampling
identity at each try). Children with q(x) = 0 (a Gumbel-top-K past q's support) are skipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..models.eagle import DraftHead
from .draft import PendingPairs, draft_extend, first_frontier, next_level, run_frontier
from .kernels.rejection import rejection_walk, split_mass
from .kv_cache import KVCache
from .rng import Site, gumbel, uniform
from .sampling import SamplingTensors, draw_tokens, sample, target_probs
from .tree import Tree, TreeShape, child_scores, choose_frontier, kept_candidates, layout_tree
from .verify import Acceptance, accept


@dataclass
class DraftDistributions:
    """What rejection sampling needs of a stochastic tree's draft.

    probs: [B, R, V_draft] float32 draft distributions of the nodes that drafted children: row
        0 the root's, then K rows per level 1..D-1 (that level's frontier, in frontier order).
    node_row: [B, N] int64 each tree node's row of `probs` (-1: it drafted no children).
    node_draft_id: [B, N] int64 each node's token as a draft id (root: 0, unused).
    """

    probs: torch.Tensor
    node_row: torch.Tensor
    node_draft_id: torch.Tensor


def _conditioned_gumbel(phi: torch.Tensor, z: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Gumbels g whose maximum is z, moved to have maximum phi: -log(e^-phi - e^-z + e^-g),
    in the numerically stable form of Kool et al. (2019), appendix B."""
    u = g - z
    log1mexp = torch.where(u > -0.6931, torch.log(-torch.expm1(u)), torch.log1p(-torch.exp(u)))
    v = phi - g + log1mexp
    out = phi - v.clamp_min(0) - torch.log1p(torch.exp(-v.abs()))
    return torch.nan_to_num(out, nan=float("-inf"))


def sampled_children(
    logits: torch.Tensor,
    parent_scores: torch.Tensor,
    parent_logp: torch.Tensor,
    topk: int,
    sampling: SamplingTensors,
    *,
    level: int,
) -> tuple[torch.Tensor, ...]:
    """The K children of each of P parents per row, drawn with the numbers of (each row's
    seed, its output position + `level`, the draft's site).

    Args:
        logits: [B, P, V] draft logits of the parents' children.
        parent_scores, parent_logp: [B, P] float32 the parents' scores and cumulative
            log-probabilities (both 0 for the root).
        sampling: per-row parameters; rows that sample and are not seeded sample
            (`SamplingTensors.samples_stochastically`).
    Returns:
        draft ids [B, P, K] (draw order), scores [B, P, K], cumulative log-probabilities
        [B, P, K] and the parents' draft distributions [B, P, V] float32. The other rows get
        the head's top-k and deterministic scores, as `expand_level` gives them.
    """
    temperature = sampling.temperature.float().view(-1, 1, 1)
    samples = sampling.samples_stochastically().view(-1, 1, 1)
    log_q = (logits.float() / torch.where(samples, temperature, 1.0)).log_softmax(-1)
    noise = gumbel(sampling.seed, sampling.counter(level), log_q.shape[1:], site=Site.DRAFT)
    perturbed, ids = torch.where(samples, log_q + noise, log_q).topk(topk, dim=-1)
    child_logq = log_q.gather(-1, ids)
    parent_scores, parent_logp = parent_scores[..., None], parent_logp[..., None]
    logp = parent_logp + child_logq
    fixed = child_scores(parent_scores, child_logq)
    drawn = _conditioned_gumbel(
        parent_scores, parent_logp + perturbed[..., :1], parent_logp + perturbed
    )
    return ids, torch.where(samples, drawn, fixed), logp, log_q.exp()


def draft_stochastic_tree(
    head: DraftHead,
    cache: KVCache,
    pending: PendingPairs,
    root: torch.Tensor,
    shape: TreeShape,
    sampling: SamplingTensors,
) -> tuple[Tree, DraftDistributions]:
    """Draft one round's tree, sampling the children of rows that sample (module docstring).

    Args: as `draft_tree` (runtime/draft.py), plus the state's per-row `sampling`.
    """
    root_feature, root_logits = draft_extend(head, cache, pending)
    batch, topk = root.shape[0], shape.topk
    device = root.device
    zeros = torch.zeros(batch, 1, device=device)
    ids, scores, logp, root_q = sampled_children(
        root_logits[:, None], zeros, zeros, topk, sampling, level=0
    )
    ids, scores, logp = ids[:, 0], scores[:, 0], logp[:, 0]
    frontier, cands = first_frontier(head.to_target_ids(ids), scores, root_feature)
    draft_ids, probs = [ids], [root_q]
    # Candidate -> row of `probs` for candidates that are expanded (every level-1 candidate).
    rows = [frontier.candidate + 1]
    side: tuple[torch.Tensor, torch.Tensor] | None = None
    for level in range(1, shape.depth):
        out, visible, side = run_frontier(head, cache, frontier, side, level)
        ids, scores, child_logp, q = sampled_children(
            out.logits, frontier.scores, logp, topk, sampling, level=level
        )
        ids, scores, parent, chosen = choose_frontier(ids, scores)
        child_logp = child_logp.flatten(1)
        frontier, level_cands = next_level(
            head.to_target_ids(ids), scores, parent, chosen,
            frontier=frontier, out=out, visible=visible, level=level, shape=shape,
        )  # fmt: skip
        logp = child_logp.gather(1, chosen)
        cands = cands.then(level_cands)
        draft_ids.append(ids)
        probs.append(q)
        if level + 1 < shape.depth:
            rows.append(_candidate_rows(chosen, level))
    kept = kept_candidates(cands.scores, shape)
    tree = dataclasses.replace(layout_tree(root, cands, shape, kept), root_logits=root_logits)
    return tree, _distributions(kept, rows, torch.cat(draft_ids, 1), torch.cat(probs, 1), shape)


def _candidate_rows(chosen: torch.Tensor, level: int) -> torch.Tensor:
    """[B, K*K] rows of `probs` for the level-(level+1) candidates, given the chosen [B, K]
    among them: those (the next frontier, expanded at the next level) get theirs, the
    others -1."""
    batch, topk = chosen.shape
    first_row = 1 + level * topk
    level_rows = torch.full((batch, topk * topk), -1, dtype=torch.int64, device=chosen.device)
    frontier_rows = first_row + torch.arange(topk, device=chosen.device).expand(batch, -1)
    return level_rows.scatter(1, chosen, frontier_rows)


def _distributions(kept, rows, draft_ids, probs, shape: TreeShape) -> DraftDistributions:
    """The kept nodes' rows and draft ids (root first), with every expanded node's q."""
    num_candidates = shape.num_candidates
    batch = kept.shape[0]
    cand_rows = torch.cat(rows, 1)
    missing = num_candidates - cand_rows.shape[1]  # the last level is never expanded
    cand_rows = torch.nn.functional.pad(cand_rows, (0, missing), value=-1)
    root_column = torch.zeros(batch, 1, dtype=torch.int64, device=kept.device)
    return DraftDistributions(
        probs=probs,
        node_row=torch.cat([root_column, cand_rows.gather(1, kept)], 1),
        node_draft_id=torch.cat([root_column, draft_ids.gather(1, kept)], 1),
    )


def accept_stochastic(
    tree: Tree,
    logits: torch.Tensor,
    draft: DraftDistributions,
    draft_to_target: torch.Tensor,
    sampling: SamplingTensors,
    *,
    shape: TreeShape,
) -> Acceptance:
    """Walk the tree by recursive rejection sampling (rows that sample without a seed;
    `rt::rejection_walk`) or by the walk of the target's draws (greedy and seeded rows); see
    the module docstring. No host sync; one draw of the bonus from the residual where each
    row stopped.

    Args:
        tree: the round's tree ([B, N]).
        logits: [B, N, V] the target's logits at every node.
        draft: the draft's distributions (`draft_stochastic_tree`).
        draft_to_target: [V_draft] int64 the target id of every draft id.
        sampling: per-row parameters.
        shape: the tree's (D, K, N).
    """
    probs = target_probs(logits, sampling)
    # Greedy and seeded rows drafted the top-k tree: the walk of the target's own draws.
    matched = accept(tree, draw_tokens(logits, sampling, tree.depth), depth=shape.depth)
    batch = probs.shape[0]
    counter = sampling.counter()
    uniforms = uniform(sampling.seed, counter, (shape.depth, shape.topk), site=Site.REJECTION)
    path, num_accepted, residual, residual_out = rejection_walk(
        probs, tree.parent, draft.node_row, draft.node_draft_id, draft.probs,
        draft_to_target, uniforms,
    )  # fmt: skip
    p = probs[torch.arange(batch, device=probs.device), path[:, -1]]
    _, p_out = split_mass(p, draft_to_target)
    bonus = sample(
        _residual(p, residual, residual_out, p_out, draft_to_target),
        sampling.seed,
        counter,
        site=Site.RESIDUAL,
    )
    samples = sampling.samples_stochastically()
    return Acceptance(
        torch.where(samples[:, None], path, matched.path),
        torch.where(samples, num_accepted, matched.num_accepted),
        torch.where(samples, bonus, matched.bonus),
    )


def _residual(p, r, r_out, p_out, draft_to_target: torch.Tensor) -> torch.Tensor:
    """The residual [B, V] to draw the bonus from: r [B, V_draft] on the draft vocabulary,
    and outside it p's own shape scaled from its mass p_out [B] to r_out [B]."""
    tiny = torch.finfo(p.dtype).tiny
    scale = torch.where(p_out > tiny, r_out / p_out.clamp_min(tiny), 0.0)
    return (p * scale[:, None]).index_copy(1, draft_to_target, r)
