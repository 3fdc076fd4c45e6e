"""A batch's decoding state: allocated once, then reset and filled by the prefill of each batch.

`allocate_state` builds the static buffers a bucket decodes in (CUDA graphs replay over them,
so they are never reallocated or rebound). `prefill` writes a fresh batch into them in two
parts: `reset_requests` copies the requests' fields from the host, then `prefill_forwards`
(device tensors only) empties the caches, runs the target over the right-padded prompts,
samples the root token, fills the draft cache with the pairs (token j+1, feature j) of the
prompt and leaves (root, last feature) pending for the first round's draft extend. With CUDA
graphs the decoder replays `prefill_forwards` as a graph captured per (bucket, padded length,
`prefill_length`) over static prompt buffers; longer prefills run it directly. A prompt
longer than the scheduler prefills between two rounds is prefilled in chunks instead
(runtime/chunked_prefill.py, with `prompt_ancestors`, `set_pending` and `emit_root`).

On the CPU every prefill pads its prompts to `prefill_length`'s lengths too, and runs them in
groups of a power of two of slots, at most CPU_PREFILL_ROWS rows (slots x length) a forward
(runtime/slots.py: `max_prefill_rows`, `prefill_plan`, `prefill_groups`): oneDNN's bfloat16
matmul keeps memory for every distinct row count it multiplies, more for more rows, so a
serving process that prefilled each batch of prompts at its own size would grow by megabytes
per new size; padded and grouped, the row counts are the few ladder values up to the cap,
plus, for prompts longer than the cap, their ladder lengths. The draft runs over as many
columns as the target (its pairs (token j+1, feature j), the last one pairing no prompt
token), so its row counts are the same.

Compiled prefills (`compile_prefill`, dynamic shapes) compile one graph for batch 1 and one
for every larger batch, whatever the prompt lengths and buckets, because every input they see
is shaped the same way (tests/runtime/test_prefill_compiles.py):
- the forwards attend to a fresh empty cache (capacity 1, length 0) instead of the bucket's
  view of the shared store: a prefill starts from an empty cache anyway, and the view's layer
  stride (sized for the largest bucket) would make Dynamo guard on whether the view is
  contiguous, i.e. on the bucket;
- the batch, length and bitmask-word dims are marked dynamic explicitly (`mark_dynamic_dims`,
  which the compiled step applies before it compiles).
  Left to `dynamic=True` they are duck-sized: a dim shares the symbol of any other input dim
  of equal value (layers, KV heads, ...), and when that one is specialised (by an op against a
  weight) the batch or prompt length is specialised with it;
- prompts are padded to _MIN_PREFILL_TOKENS columns and bitmasks to _MIN_MASK_WORDS words, so
  no length (target and draft T) or word count is ever 1: Dynamo specialises sizes 0 and 1.
  Padding is invisible to the valid positions (causal) and beyond each slot's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..models.attention import chain_ancestors
from ..models.eagle import DraftHead
from ..models.llama import AttentionInputs, Llama
from .config import SamplingParams
from .draft import PendingPairs
from .kv_cache import KVCache
from .requests import stop_ids
from .rng import seed_halves
from .round import FINISH_NONE, SpecState, emit, round_report
from .sampling import SamplingTensors, draw_tokens

# Prompt columns the forwards see at least (target and draft T >= 3) and int64 words of their
# ancestor bitmasks (>= 2): no dynamic size is 0 or 1, so none is specialised.
_MIN_PREFILL_TOKENS = 3
_MIN_MASK_WORDS = 2
# The shortest padded prompt length (see prefill_length).
_MIN_PADDED_PREFILL_TOKENS = 16


def state_capacity(prompt_length: int, max_new_tokens: int, depth: int) -> int:
    """KV positions a slot needs: a slot's last round may commit up to D+1 tokens past its
    limit, and a finished slot still writes (without committing) D+1 entries per round."""
    return prompt_length + max_new_tokens + 2 * (depth + 1)


def allocate_caches(
    target: Llama, head: DraftHead | None, *, batch_size: int, capacity: int
) -> tuple[KVCache, KVCache | None]:
    """Zeroed target and (with a head) draft KV caches in the target's dtype and device."""
    weight = target.lm_head.weight
    common = dict(
        batch_size=batch_size, capacity=capacity, dtype=weight.dtype, device=weight.device
    )
    target_cache = KVCache.allocate(target.config, **common)
    if head is None:
        return target_cache, None
    return target_cache, KVCache.allocate(head.config.layer, num_layers=head.num_layers, **common)


def allocate_state(
    target: Llama,
    head: DraftHead | None,
    *,
    batch_size: int,
    capacity: int,
    depth: int,
    target_cache: KVCache | None = None,
    draft_cache: KVCache | None = None,
) -> SpecState:
    """Zeroed state for `batch_size` slots of `capacity` positions (depth 0: plain decoding).

    target_cache, draft_cache: existing caches to decode in (views of a larger store), else
    fresh ones are allocated.
    """
    weight = target.lm_head.weight
    device, dtype = weight.device, weight.dtype
    if target_cache is None or (head is not None and draft_cache is None):
        target_cache, draft_cache = allocate_caches(
            target, head, batch_size=batch_size, capacity=capacity
        )
    zeros = torch.zeros(batch_size, dtype=torch.int64, device=device)
    num_output = zeros.clone()
    return SpecState(
        target=target_cache,
        draft=draft_cache if head is not None else None,
        root=zeros.clone(),
        pending=None
        if head is None
        else _pending_buffers(head, batch_size, depth, dtype=dtype, device=device),
        output=torch.zeros(batch_size, capacity, dtype=torch.int64, device=device),
        num_output=num_output,
        max_new=zeros.clone(),
        stop_mask=torch.zeros(
            batch_size, target.config.vocab_size, dtype=torch.bool, device=device
        ),
        done=torch.ones(batch_size, dtype=torch.bool, device=device),
        finish=zeros.clone(),
        sampling=SamplingTensors(
            temperature=torch.zeros(batch_size, device=device),
            top_k=zeros.clone(),
            top_p=torch.ones(batch_size, device=device),
            seed=torch.zeros(batch_size, 2, dtype=torch.int64, device=device),
            position=num_output,
            seeded=torch.zeros(batch_size, dtype=torch.bool, device=device),
        ),
    )


def _pending_buffers(
    head: DraftHead, batch_size: int, depth: int, *, dtype: torch.dtype, device: torch.device
) -> PendingPairs:
    return PendingPairs(
        tokens=torch.zeros(batch_size, depth + 1, dtype=torch.int64, device=device),
        features=torch.zeros(
            batch_size, depth + 1, head.config.layer.hidden_size, dtype=dtype, device=device
        ),
        num_valid=torch.zeros(batch_size, dtype=torch.int64, device=device),
    )


def prefill(
    target: Llama,
    head: DraftHead | None,
    state: SpecState,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    length: int | None = None,
    target_forward: Callable | None = None,
    draft_forward: Callable | None = None,
) -> torch.Tensor:
    """Reset `state` for a fresh batch (one prompt per slot) and prefill it.

    length: the columns the prompts are padded to (`padded_prompts`; default the longest
    prompt), at most the state's capacity.
    target_forward, draft_forward: what runs the prompt forwards (a compiled step); the
    modules themselves by default. Returns the prefill's report [B, 7] int64 (ReportColumns:
    the root token as the one token emitted).
    """
    device = state.root.device
    reset_requests(state, params, eos_token_ids, vocab_size=target.config.vocab_size)
    tokens, lengths = (
        x.to(device, non_blocking=True)
        for x in padded_prompts(prompts, length=length, pinned=device.type == "cuda")
    )
    return prefill_forwards(
        target,
        head,
        state,
        tokens,
        lengths,
        target_forward=target_forward,
        draft_forward=draft_forward,
    )


def prefill_forwards(
    target: Llama,
    head: DraftHead | None,
    state: SpecState,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    *,
    target_forward: Callable | None = None,
    draft_forward: Callable | None = None,
) -> torch.Tensor:
    """The device side of a prefill, after `reset_requests`: empty caches and outputs, the
    prompt forwards, the root token and the draft's pending pair (`head` None: the target's
    forward only; a state with a draft cache keeps it empty). Only device tensors, no
    host synchronisation and no branching on values, so it can be captured as a CUDA graph;
    running it again over the same inputs rebuilds the same state (but for the sampled root).

    Args:
        tokens: [B, T] int64 right-padded prompts (T >= 3); padding is never attended to.
        lengths: [B] int64 prompt lengths (1 <= length <= T).
    Returns the prefill's report [B, 7] int64 (ReportColumns).
    """
    device = tokens.device
    state.num_output.zero_()
    state.finish.fill_(FINISH_NONE)
    state.target.lengths.zero_()
    positions = _positions(*tokens.shape, device)
    attn = _empty_cache_inputs(state.target, prompt_ancestors(*tokens.shape, device))
    out = (target_forward or target)(tokens, positions, attn)
    state.target.append(out.k_new, out.v_new, lengths)
    rows = torch.arange(tokens.shape[0], device=device)
    last = out.hidden[rows, lengths - 1]
    state.root.copy_(draw_tokens(target.logits(last), state.sampling))
    if head is not None:
        state.draft.lengths.zero_()
        features = head.target_features(out)
        _prefill_draft(draft_forward or head, state, tokens, features, lengths)
    elif state.draft is not None:
        # Prefilled without the head: an empty draft cache and (root, zero feature) pending,
        # so a tree round stays in bounds (its drafts are accepted by chance only).
        state.draft.lengths.zero_()
        set_pending(state.pending, state.root, torch.zeros_like(state.pending.features[:, 0]))
    return emit_root(state)


def emit_root(state: SpecState) -> torch.Tensor:
    """Emit each slot's root token as its first output (none where max_new_tokens is 0).
    Returns the prefill report [B, 7] int64 (ReportColumns)."""
    was_done = state.max_new == 0
    ones = torch.ones_like(state.root)
    num_emitted = emit(state, state.root[:, None], ones, was_done)
    return round_report(state, state.root[:, None], num_emitted, torch.zeros_like(ones))


def padded_prompts(
    prompts: Sequence[Sequence[int]], *, length: int | None = None, pinned: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors: prompts right-padded with zeros to `length` columns (default the longest
    prompt, at least _MIN_PREFILL_TOKENS) [B, T] int64 and their lengths [B] int64; in
    pinned memory if `pinned` (for copies to the device that do not synchronise)."""
    length = prefill_columns(prompts) if length is None else length
    assert length >= prefill_columns(prompts), (length, prompts)
    tokens = torch.zeros(len(prompts), length, dtype=torch.int64)
    for slot, prompt in enumerate(prompts):
        tokens[slot, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    if pinned:
        return tokens.pin_memory(), lengths.pin_memory()
    return tokens, lengths


def prefill_columns(prompts: Sequence[Sequence[int]]) -> int:
    """The columns `padded_prompts` pads a batch to by default: its longest prompt, at least
    _MIN_PREFILL_TOKENS."""
    return max(_MIN_PREFILL_TOKENS, *map(len, prompts))


def prefill_length(num_tokens: int, *, max_length: int | None = None) -> int:
    """The padded length of a prefill of up to `num_tokens` prompt tokens (what a prefill
    graph is captured for, what a CPU prefill or chunk pads to): the smallest of 16, 24, 32,
    48, 64, 96, ... (2^k and 1.5 * 2^k: at most a third of the columns are padding) that
    holds `num_tokens`, capped at `max_length` (the KV capacity the padded columns are
    written into; None: no cap)."""
    length = _MIN_PADDED_PREFILL_TOKENS
    while length < num_tokens:
        length = length * 3 // 2 if length & (length - 1) == 0 else length * 4 // 3
    return length if max_length is None else min(length, max_length)


def reset_requests(
    state: SpecState,
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    vocab_size: int,
) -> None:
    """Copy a fresh batch's per-slot request fields (sampling, limits, stop tokens) into
    `state`, without synchronising; `prefill_forwards` resets the rest.

    The fields travel as one host tensor [B, 7 + S] float64 (exact for limits, token ids
    and 32-bit halves): temperature, top_k, top_p, max_new_tokens, the seed's two halves (a
    fresh seed for a request without one), whether the request gave its seed, then the S
    stop ids (rows with fewer repeat their
    first; -1 for none), pinned on CUDA, in one transfer; the stop masks are scattered from
    the ids on the device. In a serving process building and pinning one
    small host tensor per field costs about 3 ms a batch-1 prefill (H100), more than the
    prefill graph runs; one tensor a batch avoids that."""
    stops = [stop_ids(p, eos_token_ids, vocab_size=vocab_size) for p in params]
    width = max(map(len, stops), default=0) or 1
    rows = [
        [
            p.temperature,
            p.top_k,
            p.top_p,
            p.max_new_tokens,
            *seed_halves(p.seed),
            p.seed is not None,
            *_padded(ids, width),
        ]
        for p, ids in zip(params, stops, strict=True)
    ]
    fields = torch.tensor(rows, dtype=torch.float64)
    if state.root.device.type == "cuda":
        fields = fields.pin_memory().to(state.root.device, non_blocking=True)
    state.sampling.temperature.copy_(fields[:, 0])
    state.sampling.top_k.copy_(fields[:, 1])
    state.sampling.top_p.copy_(fields[:, 2])
    state.max_new.copy_(fields[:, 3])
    state.done.copy_(fields[:, 3] == 0)
    state.sampling.seed.copy_(fields[:, 4:6])
    state.sampling.seeded.copy_(fields[:, 6] != 0)
    ids = fields[:, 7:].long()
    state.stop_mask.zero_().scatter_(1, ids.clamp_min(0), ids >= 0)


def _padded(ids: list[int], width: int) -> list[int]:
    """`ids` filled up to `width` with its first id (writing a stop again is harmless), or
    all -1 when empty."""
    return ids + ids[:1] * (width - len(ids)) if ids else [-1] * width


def _prefill_draft(
    draft_forward: Callable,
    state: SpecState,
    tokens: torch.Tensor,
    features: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Draft over pairs (token j+1, feature j) of the prompt's T columns; (root, last
    feature) pending. All T columns run, as the target's do, so that the draft multiplies
    the same row counts (see slots.max_prefill_rows); the last pair, (the first token, feature
    T-1), pairs no prompt token and its K/V are not written."""
    batch, length = tokens.shape
    device = tokens.device
    positions = _positions(batch, length, device)
    attn = _empty_cache_inputs(state.draft, prompt_ancestors(batch, length, device))
    # Fresh tensors, not views of the prompt (a view's base would be a graph input with
    # unmarked dims): the rolled tokens, and the features as the head computed them.
    out = draft_forward(tokens.roll(-1, dims=1), features, positions, attn)
    k_new, v_new = (kv[:, :, :, : length - 1] for kv in (out.k_new, out.v_new))
    state.draft.append(k_new, v_new, lengths - 1)
    rows = torch.arange(batch, device=device)
    set_pending(state.pending, state.root, features[rows, lengths - 1])


def set_pending(pending: PendingPairs, root: torch.Tensor, features: torch.Tensor) -> None:
    """Leave one pair pending per slot: the root token [B] int64 with the target's feature
    [B, H] at the prompt's last position, for the first round's draft extend."""
    pending.tokens.zero_()
    pending.tokens[:, 0] = root
    pending.features.zero_()
    pending.features[:, 0] = features
    pending.num_valid.fill_(1)


def _positions(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Positions [B, T] 0..T-1, materialised: a compiled prefill guards on strides, and a
    broadcast (stride-0) view's strides change with the batch size."""
    return torch.arange(length, device=device).repeat(batch, 1)


def prompt_ancestors(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Causal ancestor bitmask [B, T, W] (a fresh tensor, W >= _MIN_MASK_WORDS: the extra
    words are zero, bits of keys past T that are never read)."""
    chain = chain_ancestors(batch, length, device)
    num_words = max(_MIN_MASK_WORDS, chain.shape[-1])
    anc = torch.zeros(batch, length, num_words, dtype=torch.int64, device=device)
    anc[..., : chain.shape[-1]] = chain
    return anc


def _empty_cache_inputs(cache: KVCache, anc: torch.Tensor) -> AttentionInputs:
    """Attention inputs over an empty cache shaped like `cache` but for one position, zeroed
    (masked out by length 0, and finite so the masked scores stay -inf): a prefill attends to
    its prompt only. Fresh tensors, unlike the bucket's views of the shared store."""
    num_layers, batch, num_heads, _, head_dim = cache.k.shape
    shape = (num_layers, batch, num_heads, 1, head_dim)
    return AttentionInputs(
        cache.k.new_zeros(shape), cache.v.new_zeros(shape), torch.zeros_like(cache.lengths), anc
    )


def mark_dynamic_dims(*inputs: torch.Tensor | AttentionInputs) -> None:
    """Mark a prefill forward's batch and length dims (and the bitmask's words) dynamic, for
    a compiled forward (`compile_prefill(..., mark_dynamic=mark_dynamic_dims)`): each gets a
    symbol of its own instead of being duck-sized. `maybe_mark_dynamic`: a dim that is
    specialised after all (batch 1) is not an error. Marks are attributes of these fresh
    tensors."""
    for value in inputs:
        if isinstance(value, AttentionInputs):
            torch._dynamo.maybe_mark_dynamic(value.anc, (0, 1, 2))
            torch._dynamo.maybe_mark_dynamic(value.cache_len, 0)
            torch._dynamo.maybe_mark_dynamic(value.k_cache, 1)
            torch._dynamo.maybe_mark_dynamic(value.v_cache, 1)
        else:  # tokens, positions [B, T]; features [B, T, H]
            torch._dynamo.maybe_mark_dynamic(value, (0, 1))
