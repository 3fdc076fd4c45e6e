"""Speculative decoding of a batch: prefill, then rounds until every slot is done.

The prefill (dynamic prompt length, outside any graph) runs the target over the prompts, samples
the root token, fills the target cache and the draft cache (pairs (token j+1, feature j)), and
leaves (root, last feature) pending for the first round's draft extend. The host loop here reads
the done flags once per round; the CUDA-graph runner replaces it with an asynchronous one
around the same `speculative_round`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..models.attention import chain_ancestors
from ..models.eagle import DraftHead
from ..models.llama import Llama
from .config import SamplingParams
from .draft import PendingPairs
from .kv_cache import KVCache
from .requests import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    check_requests,
    seeded_rng,
    stop_mask,
)
from .round import FINISH_NONE, SpecState, draft_phase, emit, verify_phase
from .sampling import SamplingTensors, sample, target_probs
from .tree import StaticTree, TreeShape

_FINISH_NAMES = {FINISH_NONE: FINISH_LENGTH, 1: FINISH_STOP, 2: FINISH_LENGTH}


@dataclass(frozen=True)
class RequestStats:
    """One request: rounds it took part in and draft tokens the target accepted."""

    num_rounds: int
    num_accepted: int

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round (accepted draft tokens + the bonus)."""
        return (self.num_accepted + self.num_rounds) / self.num_rounds if self.num_rounds else 0.0


@dataclass
class SpecStats:
    """Statistics of one run: rounds, accepted draft tokens per slot-round (histogram over
    0..D), wall time of the prefill and of the rounds, and per-request totals."""

    num_rounds: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    per_request: list[RequestStats] = field(default_factory=list)

    @property
    def round_seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per slot-round (accepted draft tokens + the bonus)."""
        total = sum(self.accepted_histogram)
        if not total:
            return 0.0
        return sum((a + 1) * n for a, n in enumerate(self.accepted_histogram)) / total


def speculative_generate(
    target: Llama,
    head: DraftHead,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    shape: TreeShape | StaticTree,
    eos_token_ids: Sequence[int] = (),
) -> tuple[list[Generation], SpecStats]:
    """Decode a batch of tokenized prompts to completion with draft trees of `shape`."""
    stats = SpecStats()
    results: list[Generation] = []
    steps = speculative_stream(
        target, head, prompts, params, shape=shape, eos_token_ids=eos_token_ids, stats=stats
    )
    for step in steps:
        results = results or [Generation([], FINISH_LENGTH) for _ in step]
        for result, (tokens, finish) in zip(results, step, strict=True):
            result.token_ids.extend(tokens)
            result.finish_reason = finish or result.finish_reason
    return results, stats


def speculative_stream(
    target: Llama,
    head: DraftHead,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    shape: TreeShape | StaticTree,
    eos_token_ids: Sequence[int] = (),
    stats: SpecStats | None = None,
) -> Iterator[list[tuple[list[int], str | None]]]:
    """Yield, after the prefill and after every round, (new tokens, finish reason or None) per
    slot. `stats`, when given, is filled in as the run goes."""
    prompts, params = check_requests(prompts, params, vocab_size=target.config.vocab_size)
    stats = stats if stats is not None else SpecStats()
    stats.accepted_histogram = [0] * (shape.depth + 1)
    device = target.lm_head.weight.device
    with seeded_rng(params, device):
        started = time.perf_counter()
        state = prefill(target, head, prompts, params, eos_token_ids, shape=shape)
        stats.prefill_seconds = time.perf_counter() - started
        num_seen = torch.zeros_like(state.num_output)
        reported = torch.zeros_like(state.done)
        while True:
            yield _new_tokens(state, num_seen, state.done & ~reported)
            num_seen, reported = state.num_output.clone(), state.done.clone()
            if bool(state.done.all()):
                break
            active = ~state.done
            timer = PhaseTimer(device)
            tree = draft_phase(head, state, shape)
            timer.mark()
            num_accepted = verify_phase(target, head, state, tree, depth=shape.depth)
            timer.mark()
            counts = torch.bincount(num_accepted[active], minlength=shape.depth + 1).tolist()
            stats.accepted_histogram = [
                a + b for a, b in zip(stats.accepted_histogram, counts, strict=True)
            ]
            stats.num_rounds += 1
            draft_seconds, verify_seconds = timer.seconds()
            stats.draft_seconds += draft_seconds
            stats.verify_seconds += verify_seconds
    stats.per_request = [
        RequestStats(rounds, accepted)
        for rounds, accepted in zip(
            state.num_rounds.tolist(), state.num_accepted.tolist(), strict=True
        )
    ]


def _new_tokens(
    state: SpecState, num_seen: torch.Tensor, just_done: torch.Tensor
) -> list[tuple[list[int], str | None]]:
    """Tokens each slot produced since `num_seen`, and its finish reason if it just ended."""
    rows = zip(
        state.output.tolist(),
        num_seen.tolist(),
        state.num_output.tolist(),
        state.finish.tolist(),
        just_done.tolist(),
        strict=True,
    )
    return [
        (out[start:end], _FINISH_NAMES[finish] if ended else None)
        for out, start, end, finish, ended in rows
    ]


def prefill(
    target: Llama,
    head: DraftHead,
    prompts: list[list[int]],
    params: list[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    shape: TreeShape | StaticTree,
) -> SpecState:
    """Build the state of a fresh batch: caches filled, root sampled, first pair pending."""
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    batch, length = len(prompts), max(map(len, prompts))
    max_new = torch.tensor([p.max_new_tokens for p in params], device=device)
    # A slot's last round may commit up to D+1 tokens past its limit, and a finished slot
    # still writes (without committing) D+1 entries per round after that.
    capacity = length + int(max_new.max()) + 2 * (shape.depth + 1)
    state = SpecState(
        target=KVCache.allocate(
            target.config, batch_size=batch, capacity=capacity, dtype=dtype, device=device
        ),
        draft=KVCache.allocate(
            head.config.layer,
            num_layers=head.num_layers,
            batch_size=batch,
            capacity=capacity,
            dtype=dtype,
            device=device,
        ),
        root=torch.zeros(batch, dtype=torch.int64, device=device),
        pending=None,
        output=torch.zeros(batch, capacity, dtype=torch.int64, device=device),
        num_output=torch.zeros(batch, dtype=torch.int64, device=device),
        max_new=max_new,
        stop_mask=stop_mask(
            params, eos_token_ids, vocab_size=target.config.vocab_size, device=device
        ),
        done=max_new == 0,
        finish=torch.full((batch,), FINISH_NONE, device=device),
        sampling=SamplingTensors.from_params(params, device),
        num_rounds=torch.zeros(batch, dtype=torch.int64, device=device),
        num_accepted=torch.zeros(batch, dtype=torch.int64, device=device),
    )
    tokens = torch.zeros(batch, length, dtype=torch.int64, device=device)
    for slot, prompt in enumerate(prompts):
        tokens[slot, : len(prompt)] = torch.tensor(prompt, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    features = _prefill_target(target, head, state, tokens, lengths)
    _prefill_draft(head, state, tokens, features, lengths, shape)
    emit(state, state.root[:, None], torch.ones_like(lengths), max_new == 0)
    return state


def _prefill_target(target, head, state, tokens, lengths) -> torch.Tensor:
    """Target over the prompts: cache filled, root sampled. Returns features [B, T, H]."""
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    anc = chain_ancestors(batch, length, tokens.device)
    out = target(tokens, positions, state.target.attention_inputs(anc))
    state.target.append(out.k_new, out.v_new, lengths)
    last = out.hidden[torch.arange(batch, device=tokens.device), lengths - 1]
    state.root = sample(target_probs(target.logits(last), state.sampling))
    return head.target_features(out)


def _prefill_draft(head, state, tokens, features, lengths, shape) -> None:
    """Draft over pairs (token j+1, feature j) of the prompt; (root, last feature) pending."""
    batch, length = tokens.shape
    rows = torch.arange(batch, device=tokens.device)
    if length > 1:
        pairs = length - 1
        positions = torch.arange(pairs, device=tokens.device).expand(batch, pairs)
        anc = chain_ancestors(batch, pairs, tokens.device)
        out = head(tokens[:, 1:], features[:, :-1], positions, state.draft.attention_inputs(anc))
        state.draft.append(out.k_new, out.v_new, lengths - 1)
    pending_tokens = torch.zeros(batch, shape.depth + 1, dtype=torch.int64, device=tokens.device)
    pending_tokens[:, 0] = state.root
    pending_features = features.new_zeros(batch, shape.depth + 1, features.shape[-1])
    pending_features[:, 0] = features[rows, lengths - 1]
    state.pending = PendingPairs(pending_tokens, pending_features, torch.ones_like(lengths))


class PhaseTimer:
    """Times consecutive phases of a round without a host sync between them: CUDA events on
    the GPU (read once the round's results are read anyway), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks = [self._now()]

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self._marks.append(self._now())

    def seconds(self) -> list[float]:
        """Duration of each phase between consecutive marks."""
        pairs = zip(self._marks, self._marks[1:], strict=False)
        if self._cuda:
            return [start.elapsed_time(end) / 1e3 for start, end in pairs]
        return [end - start for start, end in pairs]
