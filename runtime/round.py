"""One decoding round as a function of device tensors: the speculative round (draft, verify,
accept, commit) and the plain autoregressive step (with or without keeping the draft in step).

Everything a round needs lives in `SpecState` on the device. A round updates the state's
tensors in place (never rebinding them), with static shapes, no host synchronisation and no
Python branching on values, so the same code runs eagerly, under torch.compile and inside a
CUDA graph that replays it over the same buffers. Slots are ragged (own lengths, own
acceptance); finished slots keep running harmlessly: they commit nothing and emit nothing.

A round returns its report, one small int64 tensor the host copies out once per round
(see `ReportColumns`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.attention import chain_ancestors
from ..models.eagle import DraftHead
from ..models.llama import Llama, ModelOutput
from .draft import PendingPairs, draft_commit, draft_static_tree, draft_tree
from .kernels import acceptance_signals as signals_kernel
from .kv_cache import KVCache
from .sampling import SamplingTensors, draw_tokens
from .stochastic import DraftDistributions, accept_stochastic, draft_stochastic_tree
from .tree import StaticTree, Tree, TreeShape
from .verify import Acceptance, accept

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
# The acceptance signals travel in the int64 report as fixed-point numbers: value * SCALE.
SIGNAL_SCALE = 2**16


@dataclass
class SpecState:
    """Per-slot decoding state, all on the device, updated in place by every round.

    target, draft: KV caches (target length = position of the root token); no draft cache
        for plain decoding.
    root: [B] int64 pending token (sampled, not yet in the target cache).
    pending: pairs the draft has not seen (the root paired with the last committed feature),
        at least D+1 wide; None for plain decoding.
    output: [B, C] int64 generated tokens; num_output: [B] int64.
    max_new: [B] int64; stop_mask: [B, V] bool; done: [B] bool; finish: [B] int64 (FINISH_*).
    sampling: per-slot sampling parameters.
    """

    target: KVCache
    draft: KVCache | None
    root: torch.Tensor
    pending: PendingPairs | None
    output: torch.Tensor
    num_output: torch.Tensor
    max_new: torch.Tensor
    stop_mask: torch.Tensor
    done: torch.Tensor
    finish: torch.Tensor
    sampling: SamplingTensors


class ReportColumns:
    """Columns of a round report [B, 6 + T] int64: how many tokens each slot emitted this
    round, how many draft tokens it accepted, its done flag and finish code (FINISH_*), the
    round's acceptance signals at the root in fixed point (`acceptance_signals`, times
    SIGNAL_SCALE; 0 where nothing was drafted), then the T tokens it emitted (only the first
    `NUM_EMITTED` are meaningful)."""

    NUM_EMITTED, NUM_ACCEPTED, DONE, FINISH, CONFIDENCE, DIVERGENCE, TOKENS = range(7)


def round_report(
    state: SpecState,
    tokens: torch.Tensor,
    num_emitted: torch.Tensor,
    num_accepted: torch.Tensor,
    signals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack one round's outcome (tokens [B, T], counts [B], signals [B, 2] float or None) as
    a [B, 6 + T] int64 report (ReportColumns)."""
    columns = [num_emitted, num_accepted, state.done.long(), state.finish]
    if signals is None:
        fixed = torch.zeros_like(tokens[:, :1]).expand(-1, 2)
    else:
        fixed = (signals * SIGNAL_SCALE).round().long()
    return torch.cat([torch.stack(columns, dim=1), fixed, tokens], dim=1)


def acceptance_signals(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_to_target: torch.Tensor,
    *,
    draft_log_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the round tells about its draft beyond the accepted length, at the root and at
    temperature 1: the draft's confidence (its top probability) and the KL divergence
    KL(p || q) of its distribution q from the target's p restricted to the draft vocabulary
    (renormalised; DSDE's signal), in one launch (`rt::acceptance_signals`). target_logits:
    [B, V]; draft_logits: [B, V_draft]; draft_to_target: [V_draft] int64; draft_log_norm: [B]
    float32 logsumexp of draft_logits if the draft has it (Tree.root_log_norm), else None.
    Returns [B, 2] float32."""
    if draft_log_norm is None:
        draft_log_norm = draft_logits.float().logsumexp(-1)
    return signals_kernel.acceptance_signals(
        target_logits, draft_logits, draft_to_target, draft_log_norm
    )


def speculative_round(
    target: Llama,
    head: DraftHead,
    state: SpecState,
    shape: TreeShape | StaticTree,
) -> torch.Tensor:
    """Run one round in place. Returns the round report [B, 6 + D + 1] int64 (ReportColumns;
    slots already done report nothing). Draws are keyed by each slot's seed and output position
    (runtime/rng.py)."""
    tree, draft = draft_phase(head, state, shape)
    return verify_phase(target, head, state, tree, shape=shape, draft=draft)


def draft_phase(
    head: DraftHead, state: SpecState, shape: TreeShape | StaticTree
) -> tuple[Tree, DraftDistributions | None]:
    """Draft extend + expand + rerank: the round's tree (the draft cache is updated), and a
    stochastic tree's draft distributions (None for the others)."""
    if isinstance(shape, StaticTree):
        return draft_static_tree(head, state.draft, state.pending, state.root, shape), None
    if shape.stochastic:
        return draft_stochastic_tree(
            head, state.draft, state.pending, state.root, shape, state.sampling
        )
    return draft_tree(head, state.draft, state.pending, state.root, shape), None


def verify_phase(
    target: Llama,
    head: DraftHead,
    state: SpecState,
    tree: Tree,
    *,
    shape: TreeShape | StaticTree,
    draft: DraftDistributions | None = None,
) -> torch.Tensor:
    """Target forward over the tree, acceptance and commit. Returns the round report. `draft`:
    a stochastic tree's draft distributions (accepted by rejection sampling), else None."""
    out = target(
        tree.tokens,
        state.target.lengths[:, None] + tree.depth,
        state.target.attention_inputs(tree.anc),
    )
    logits = target.logits(out.hidden)
    draft_ids = torch.arange(tree.root_logits.shape[-1], device=logits.device)
    draft_to_target = head.to_target_ids(draft_ids)
    signals = acceptance_signals(
        logits[:, 0], tree.root_logits, draft_to_target, draft_log_norm=tree.root_log_norm
    )
    if draft is None:
        # One draw from the target at every node; each is used at most once along the path.
        drawn = draw_tokens(logits, state.sampling, tree.depth)
        acceptance = accept(tree, drawn, depth=shape.depth)
    else:
        acceptance = accept_stochastic(
            tree, logits, draft, draft_to_target, state.sampling, shape=shape
        )
    was_done = state.done.clone()
    _commit_target(state, out.k_new, out.v_new, acceptance, was_done)
    emitted = _emitted_tokens(tree, acceptance)
    num_emitted = emit(state, emitted, acceptance.num_accepted + 1, was_done)
    features = head.target_features(out)
    # The pending buffers may be wider than D+1 (sized for the deepest tree of any bucket a
    # slot can move to); the columns past num_valid are padding.
    width = emitted.shape[1]
    state.pending.tokens[:, :width].copy_(emitted)
    state.pending.features[:, :width].copy_(_gather_nodes(features, acceptance.path))
    state.pending.num_valid.copy_(torch.where(was_done, 0, acceptance.num_accepted + 1))
    state.root.copy_(acceptance.bonus)
    num_accepted = torch.where(was_done, 0, acceptance.num_accepted)
    return round_report(state, emitted, num_emitted, num_accepted, signals)


def decode_round(target: Llama, state: SpecState) -> torch.Tensor:
    """One plain autoregressive step in place: the root enters the cache, the next token is
    sampled and emitted. Returns the round report [B, 7] int64 (ReportColumns)."""
    return _decode_step(target, state)[0]


def synced_decode_round(
    target: Llama, head: DraftHead, state: SpecState, *, num_pending: int
) -> torch.Tensor:
    """A plain step that keeps the draft in step, so that any later round may speculate: the
    first `num_pending` pending columns (at least every row's `num_valid`: the whole width
    after a speculative round, 1 after a prefill or a plain step) are committed to the draft
    cache, then `decode_round`, whose (token, root feature) pair becomes the one pending.
    Returns the round report [B, 7] int64."""
    pending = state.pending
    draft_commit(
        head,
        state.draft,
        PendingPairs(
            pending.tokens[:, :num_pending],
            pending.features[:, :num_pending],
            pending.num_valid.clamp_max(num_pending),
        ),
    )
    report, out, token, was_done = _decode_step(target, state)
    pending.tokens[:, :1].copy_(token[:, None])
    pending.features[:, :1].copy_(head.target_features(out))
    pending.num_valid.copy_((~was_done).long())
    return report


def appending_decode_round(target: Llama, head: DraftHead, state: SpecState) -> torch.Tensor:
    """A plain step that leaves the draft behind: its (token, root feature) pair is appended
    to each live row's pending pairs, for the next round that speculates or commits to put
    into the draft cache. Every live row must have room (`num_valid` below the pending width,
    as RoundPlanner.plan sees to). Returns the round report [B, 7] int64."""
    pending = state.pending
    report, out, token, was_done = _decode_step(target, state)
    width = pending.tokens.shape[1]
    column = pending.num_valid.clamp_max(width - 1)[:, None]
    pending.tokens.scatter_(1, column, token[:, None])
    features = head.target_features(out)
    pending.features.scatter_(1, column[:, :, None].expand_as(features), features)
    pending.num_valid.add_((~was_done).long())
    return report


def _decode_step(
    target: Llama, state: SpecState
) -> tuple[torch.Tensor, ModelOutput, torch.Tensor, torch.Tensor]:
    """decode_round's work: its report, the target's output at the root, the drawn token [B]
    and which slots were done before the step [B] bool."""
    batch = state.root.shape[0]
    out = target(
        state.root[:, None],
        state.target.lengths[:, None],
        state.target.attention_inputs(chain_ancestors(batch, 1, state.root.device)),
    )
    was_done = state.done.clone()
    state.target.append(out.k_new, out.v_new, (~was_done).long())
    token = draw_tokens(target.logits(out.hidden[:, 0]), state.sampling)
    num_emitted = emit(state, token[:, None], torch.ones_like(token), was_done)
    state.root.copy_(token)
    report = round_report(state, token[:, None], num_emitted, torch.zeros_like(token))
    return report, out, token, was_done


def _commit_target(
    state: SpecState,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    acceptance: Acceptance,
    was_done: torch.Tensor,
) -> None:
    """Copy the accepted path's K/V (root included) from the verify into the target cache."""
    num_layers, batch, num_heads, _, head_dim = k_new.shape
    index = acceptance.path.view(1, batch, 1, -1, 1)
    index = index.expand(num_layers, batch, num_heads, -1, head_dim)
    num_commit = torch.where(was_done, 0, acceptance.num_accepted + 1)
    state.target.append(k_new.gather(3, index), v_new.gather(3, index), num_commit)


def _emitted_tokens(tree: Tree, acceptance: Acceptance) -> torch.Tensor:
    """[B, D+1]: the accepted draft tokens then the bonus (entries past the bonus: the bonus)."""
    path_tokens = tree.tokens.gather(1, acceptance.path)[:, 1:]
    bonus = acceptance.bonus[:, None]
    step = torch.arange(path_tokens.shape[1] + 1, device=bonus.device)
    accepted = torch.cat([path_tokens, bonus], dim=1)
    return torch.where(step < acceptance.num_accepted[:, None], accepted, bonus)


def emit(
    state: SpecState, tokens: torch.Tensor, num_tokens: torch.Tensor, was_done: torch.Tensor
) -> torch.Tensor:
    """Append up to num_tokens [B] of tokens [B, T] per slot, cut at a stop token or the
    max_new limit, and mark finished slots. Returns the number kept per slot [B] int64."""
    step = torch.arange(tokens.shape[1], device=tokens.device)
    is_stop = state.stop_mask.gather(1, tokens) & (step < num_tokens[:, None])
    has_stop = is_stop.any(dim=-1)
    through_stop = torch.where(has_stop, is_stop.int().argmax(dim=-1) + 1, num_tokens)
    room = state.max_new - state.num_output
    num_kept = torch.where(was_done, 0, torch.minimum(through_stop, room))
    index = state.num_output[:, None] + step
    state.output.scatter_(1, index, tokens)
    state.num_output += num_kept
    stopped = ~was_done & has_stop & (through_stop <= room)
    full = ~was_done & ~stopped & (state.num_output >= state.max_new)
    state.finish.copy_(
        torch.where(stopped, FINISH_STOP, torch.where(full, FINISH_LENGTH, state.finish))
    )
    state.done |= stopped | full
    return num_kept


def _gather_nodes(x: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """x: [B, N, F], nodes: [B, J] -> [B, J, F]."""
    return x.gather(1, nodes[..., None].expand(-1, -1, x.shape[-1]))
