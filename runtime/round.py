"""One speculative round as a function of device tensors: draft, verify, accept, commit.

Everything a round needs lives in `SpecState` on the device; a round reads and updates it with
static shapes, no host synchronisation and no Python branching on values, so the same code
runs eagerly, under torch.compile and inside a CUDA graph. Slots are ragged (own lengths, own
acceptance); finished slots keep running harmlessly: they commit nothing and emit nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.eagle import DraftHead
from ..models.llama import Llama
from .draft import PendingPairs, draft_static_tree, draft_tree
from .kv_cache import KVCache
from .sampling import SamplingTensors, target_probs
from .tree import StaticTree, Tree, TreeShape
from .verify import Acceptance, accept, target_tokens

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2


@dataclass
class SpecState:
    """Per-slot decoding state, all on the device.

    target, draft: KV caches (target length = position of the root token).
    root: [B] int64 pending token (sampled, not yet in the target cache).
    pending: pairs the draft has not seen (the root paired with the last committed feature).
    output: [B, C] int64 generated tokens; num_output: [B] int64.
    max_new: [B] int64; stop_mask: [B, V] bool; done: [B] bool; finish: [B] int64 (FINISH_*).
    sampling: per-slot sampling parameters.
    num_rounds, num_accepted: [B] int64 rounds a slot took part in, draft tokens it accepted.
    """

    target: KVCache
    draft: KVCache
    root: torch.Tensor
    pending: PendingPairs
    output: torch.Tensor
    num_output: torch.Tensor
    max_new: torch.Tensor
    stop_mask: torch.Tensor
    done: torch.Tensor
    finish: torch.Tensor
    sampling: SamplingTensors
    num_rounds: torch.Tensor
    num_accepted: torch.Tensor


def speculative_round(
    target: Llama,
    head: DraftHead,
    state: SpecState,
    shape: TreeShape | StaticTree,
) -> torch.Tensor:
    """Run one round in place. Returns num_accepted [B] int64 (draft tokens accepted; 0 for
    slots that were already done). Samples from the default RNG of the state's device."""
    tree = draft_phase(head, state, shape)
    return verify_phase(target, head, state, tree, depth=shape.depth)


def draft_phase(head: DraftHead, state: SpecState, shape: TreeShape | StaticTree) -> Tree:
    """Draft extend + expand + rerank: the round's tree (the draft cache is updated)."""
    if isinstance(shape, StaticTree):
        return draft_static_tree(head, state.draft, state.pending, state.root, shape)
    return draft_tree(head, state.draft, state.pending, state.root, shape)


def verify_phase(
    target: Llama, head: DraftHead, state: SpecState, tree: Tree, *, depth: int
) -> torch.Tensor:
    """Target forward over the tree, acceptance and commit. Returns num_accepted [B]."""
    out = target(
        tree.tokens,
        state.target.lengths[:, None] + tree.depth,
        state.target.attention_inputs(tree.anc),
    )
    probs = target_probs(target.logits(out.hidden), state.sampling)
    acceptance = accept(tree, target_tokens(probs), depth=depth)
    was_done = state.done.clone()
    _commit_target(state, out.k_new, out.v_new, acceptance, was_done)
    emitted = _emitted_tokens(tree, acceptance)
    emit(state, emitted, acceptance.num_accepted + 1, was_done)
    features = head.target_features(out)
    state.pending = PendingPairs(
        tokens=emitted,
        features=_gather_nodes(features, acceptance.path),
        num_valid=torch.where(was_done, 0, acceptance.num_accepted + 1),
    )
    state.root = acceptance.bonus
    num_accepted = torch.where(was_done, 0, acceptance.num_accepted)
    state.num_rounds += (~was_done).long()
    state.num_accepted += num_accepted
    return num_accepted


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
) -> None:
    """Append up to num_tokens [B] of tokens [B, T] per slot, cut at a stop token or the
    max_new limit, and mark finished slots."""
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
    state.finish = torch.where(stopped, FINISH_STOP, torch.where(full, FINISH_LENGTH, state.finish))
    state.done = state.done | stopped | full


def _gather_nodes(x: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """x: [B, N, F], nodes: [B, J] -> [B, J, F]."""
    return x.gather(1, nodes[..., None].expand(-1, -1, x.shape[-1]))
