"""Slot operations between rounds, the mechanism of continuous batching: views of a bucket's
first slots, admitting new requests into free slots while the other slots keep their KV
caches, positions and random streams, releasing slots, moving live slots, and saving the small
per-slot tensors around a warm-up that runs rounds over a live state.

Every bucket decodes in a view of the first `bucket` slots of one store (`slot_view`), so a
batch grows into a larger bucket without copying anything, and shrinks by moving its live
slots below the smaller bucket's size (`move`). Slots not owned by a request are done: a round
runs them harmlessly.

`admit` prefills the new prompts into a small staging state of their own (`prefill`, with the
compiled prefill forwards when given: dynamic shapes, so any number of requests and prompt
lengths reuse the graphs compiled for batch 1 and for larger batches) and copies the result
into the chosen slots (`copy_rows`: the prompt's K/V positions, the root token, the draft's
pending pair, the request fields and the emitted root). A round over the whole bucket then
decodes the new slots with the old ones; free slots are done and ask for nothing. A prompt
too long to prefill between two rounds fills a staging state of its own chunk by chunk
(runtime/chunked_prefill.py) and is installed the same way after its last chunk. Each
request's random numbers are keyed by its own seed and positions (runtime/rng.py), so where
and when it is admitted does not change what it samples.

On the CPU a batch or an admission is prefilled in groups of slots, each over views of its
rows (`slot_view(first=)`, `prefill_groups`), padded and at most `max_prefill_rows` rows a
forward (`prefill_plan`; runtime/prefill.py says why).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import torch

from ..models.eagle import DraftHead
from ..models.llama import Llama
from .config import SamplingParams
from .kv_cache import KVCache
from .prefill import allocate_state, prefill, prefill_columns, prefill_length
from .round import SpecState
from .sampling import SamplingTensors

# The most rows (slots x padded length) a CPU prefill forward multiplies, a ladder value
# (prefill_length): past a few hundred rows a forward's GEMMs outweigh its per-call host work
# (the embedded model with its head, bfloat16 on 2 cores: about 35 ms of 590 ms at 512
# rows), so smaller forwards cost little, and oneDNN's memory per row count grows with the
# rows (about 0.7 MB per weight shape at 256 rows, up to 7 MB at 4096).
CPU_PREFILL_ROWS = 512


def max_prefill_rows(device: torch.device) -> int | None:
    """The most rows (slots x padded length) a prefill forward on `device` multiplies where
    no graph runs it, its prompts (and chunks) padded to `prefill_length`'s lengths and
    grouped by `prefill_plan`; None: one unpadded forward.

    On the CPU, CPU_PREFILL_ROWS: oneDNN's bfloat16 matmul keeps memory for every distinct
    row count (and weight shape) it multiplies and never releases it, so the row counts a
    process ever multiplies must stay a small set. float32 and float16 prefills, whose
    matmuls keep nothing, are shaped the same way: one code path for every dtype, at the
    cost of the padded columns (at most a third of them). Elsewhere (CUDA) prefills without
    a graph run unpadded."""
    return CPU_PREFILL_ROWS if device.type == "cpu" else None


def prefill_plan(
    prompt_lengths: Sequence[int], *, max_rows: int, capacity: int
) -> list[tuple[int, int, int]]:
    """How a CPU prefill of prompts of these lengths runs (`max_prefill_rows`): one forward
    per (first slot, slots, padded length), slots in order. Each group is a power of two of
    consecutive slots padded to `prefill_length` of its longest prompt (at most `capacity`),
    as many as fit in `max_rows` rows (slots x length), at least one: so every forward's
    rows are a ladder value up to max_rows or, for a prompt longer than that, its own
    padded length; and a short prompt is not padded to a long one's length."""
    plan = []
    first = 0
    while first < len(prompt_lengths):
        size = 1
        while first + 2 * size <= len(prompt_lengths):
            length = _group_length(prompt_lengths[first : first + 2 * size], capacity)
            if 2 * size * length > max_rows:
                break
            size *= 2
        plan.append((first, size, _group_length(prompt_lengths[first : first + size], capacity)))
        first += size
    return plan


def _group_length(prompt_lengths: Sequence[int], capacity: int) -> int:
    return prefill_length(max(prompt_lengths), max_length=capacity)


def admit(
    target: Llama,
    head: DraftHead | None,
    state: SpecState,
    slots: Sequence[int],
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    max_rows: int | None = None,
    target_forward: Callable | None = None,
    draft_forward: Callable | None = None,
    drafted: bool = True,
) -> torch.Tensor:
    """Prefill one request per slot into `slots` of `state`, leaving every other slot as it
    is. The slots must be free (done); the caller checks that prompt + max_new_tokens fit.

    max_rows: prefill in padded groups of forwards of at most this many rows
    (`prefill_groups`; None: one unpadded forward).
    drafted: False: the head does not run over the prompts (their draft stays empty).
    Returns the prefill report [len(slots), 7] int64 (ReportColumns: the root token emitted)
    of the admitted slots, in `slots` order.
    """
    assert len(slots) == len(prompts) == len(params) > 0, (slots, len(prompts), len(params))
    num_columns = prefill_columns(prompts)
    if max_rows is not None:
        num_columns = prefill_length(num_columns, max_length=state.target.capacity)
    staging = allocate_state(
        target,
        head,
        batch_size=len(slots),
        capacity=num_columns,
        depth=0 if state.pending is None else state.pending.tokens.shape[1] - 1,
    )
    report = prefill_groups(
        target,
        head if drafted else None,
        staging,
        prompts,
        params,
        eos_token_ids,
        max_rows=max_rows,
        target_forward=target_forward,
        draft_forward=draft_forward,
    )
    copy_rows(staging, state, slots, num_positions=num_columns)
    return report


def copy_rows(
    source: SpecState, dest: SpecState, slots: Sequence[int], *, num_positions: int
) -> None:
    """Rows 0..len(slots)-1 of every per-slot tensor of `source` (a staging state that was
    just prefilled) into `slots` of `dest`: the first `num_positions` K/V positions and output
    columns (at least the padded prompts; the rest of the output rows is zeroed), every other
    tensor whole."""
    index = slot_index(slots, dest.root.device)
    num_rows = len(slots)
    pairs = zip(
        _per_slot_tensors(source, with_caches=True),
        _per_slot_tensors(dest, with_caches=True),
        strict=True,
    )
    for (tensor, dim), (into, _) in pairs:
        rows = tensor.narrow(dim, 0, num_rows)
        if tensor.dim() == 5:  # K/V [layers, slots, heads, positions, head_dim]
            rows, into = rows[..., :num_positions, :], into[..., :num_positions, :]
        elif tensor is source.output:
            into.index_fill_(0, index, 0)
            rows, into = rows[:, :num_positions], into[:, :num_positions]
        into.index_copy_(dim, index, rows)


def slot_index(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    """Slot numbers as a device int64 tensor, copied from pinned memory on CUDA so that the
    copy does not wait for the rounds already queued."""
    index = torch.tensor(list(slots), dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)


def slot_view(state: SpecState, num_slots: int, *, first: int = 0) -> SpecState:
    """The state of `num_slots` slots from slot `first` (by default the first ones): views
    sharing the store's memory (contiguous along the slot dimension, so their strides do not
    depend on `num_slots`)."""
    if first == 0 and state.root.shape[0] == num_slots:
        return state
    rows = slice(first, first + num_slots)

    def cache(c: KVCache | None) -> KVCache | None:
        return None if c is None else KVCache(c.k[:, rows], c.v[:, rows], c.lengths[rows])

    num_output = state.num_output[rows]
    sampling = state.sampling
    return SpecState(
        target=cache(state.target),
        draft=cache(state.draft),
        root=state.root[rows],
        pending=None
        if state.pending is None
        else type(state.pending)(
            *(getattr(state.pending, f.name)[rows] for f in dataclasses.fields(state.pending))
        ),
        output=state.output[rows],
        num_output=num_output,
        max_new=state.max_new[rows],
        stop_mask=state.stop_mask[rows],
        done=state.done[rows],
        finish=state.finish[rows],
        sampling=SamplingTensors(
            temperature=sampling.temperature[rows],
            top_k=sampling.top_k[rows],
            top_p=sampling.top_p[rows],
            seed=sampling.seed[rows],
            position=num_output,
            seeded=sampling.seeded[rows],
            filtered=sampling.filtered,
        ),
    )


def prefill_groups(
    target: Llama,
    head: DraftHead | None,
    state: SpecState,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    max_rows: int | None = None,
    target_forward: Callable | None = None,
    draft_forward: Callable | None = None,
) -> torch.Tensor:
    """`prefill` of every slot of `state` (one prompt each): in one forward over prompts
    padded to the longest (max_rows None), or as `prefill_plan` groups them for forwards of
    at most `max_rows` rows, each group over views of its slots' rows. Returns the prefill
    report [B, 7] int64."""
    forwards = dict(target_forward=target_forward, draft_forward=draft_forward)
    if max_rows is None:
        return prefill(target, head, state, prompts, params, eos_token_ids, **forwards)
    plan = prefill_plan(
        [len(p) for p in prompts], max_rows=max_rows, capacity=state.target.capacity
    )
    reports = []
    for first, size, length in plan:
        rows = slice(first, first + size)
        group = slot_view(state, size, first=first)
        report = prefill(target, head, group, prompts[rows], params[rows], eos_token_ids,
                         length=length, **forwards)  # fmt: skip
        reports.append(report)
    return reports[0] if len(reports) == 1 else torch.cat(reports)


def release(state: SpecState, slots: Sequence[int]) -> None:
    """Mark `slots` done (a cancelled request's, or slots vacated by a move): the rounds
    already queued finish their work on them, later rounds skip them."""
    if slots:
        # index_fill_, not item assignment: that copies the value from pageable host memory,
        # a synchronising copy.
        state.done.index_fill_(0, slot_index(slots, state.root.device), True)


def move(state: SpecState, sources: Sequence[int], dests: Sequence[int]) -> None:
    """Move live slots: every per-slot tensor's row of each source slot into its destination
    slot (free ones), then release the sources."""
    assert len(sources) == len(dests) and not set(sources) & set(dests), (sources, dests)
    if not sources:
        return
    device = state.root.device
    source, dest = slot_index(sources, device), slot_index(dests, device)
    for tensor, dim in _per_slot_tensors(state, with_caches=True):
        tensor.index_copy_(dim, dest, tensor.index_select(dim, source))
    release(state, sources)


def copy_slots(source: SpecState, dest: SpecState) -> None:
    """Every per-slot tensor of `source` into `dest`, a state of the same shapes."""
    pairs = zip(
        _per_slot_tensors(source, with_caches=True),
        _per_slot_tensors(dest, with_caches=True),
        strict=True,
    )
    for (tensor, _), (into, _) in pairs:
        into.copy_(tensor)


def save_rows(state: SpecState) -> list[torch.Tensor]:
    """Copies of the small per-slot tensors (all but the K/V and output buffers), for
    `restore_rows` after warm-up rounds have run over a live state: those rounds write K/V and
    outputs only past each slot's length and output count, which the restored rows keep."""
    return [tensor.clone() for tensor, _ in _per_slot_tensors(state, with_caches=False)]


def restore_rows(state: SpecState, saved: list[torch.Tensor]) -> None:
    for (tensor, _), copy in zip(_per_slot_tensors(state, with_caches=False), saved, strict=True):
        tensor.copy_(copy)


def _per_slot_tensors(state: SpecState, *, with_caches: bool) -> Iterator[tuple[torch.Tensor, int]]:
    """(tensor, slot dimension) of every per-slot tensor of the state, each once; K/V and the
    output buffer only `with_caches`."""
    for cache in (state.target, state.draft):
        if cache is not None:
            yield cache.lengths, 0
            if with_caches:
                yield cache.k, 1
                yield cache.v, 1
    if state.pending is not None:
        for f in dataclasses.fields(state.pending):
            yield getattr(state.pending, f.name), 0
    if with_caches:
        yield state.output, 0
    for tensor in (state.root, state.num_output, state.max_new, state.stop_mask, state.done,
                   state.finish):  # fmt: skip
        yield tensor, 0
    sampling = state.sampling
    for tensor in (
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.seed,
        sampling.seeded,
    ):
        yield tensor, 0
