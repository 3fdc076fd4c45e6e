"""Slot operations between rounds: admitting new requests into free slots of a running
bucket's state while the other slots keep their KV caches, positions and random streams (the
mechanism of continuous batching).

`admit` prefills the new prompts into a small staging state of their own (`prefill`, with the
compiled prefill forwards when given: dynamic shapes, so any number of requests and prompt
lengths reuse the graphs compiled for batch 1 and for larger batches) and copies the result
into the chosen slots: the prompt's K/V positions, the root token, the draft's pending pair,
the request fields and the emitted root. A round over the whole bucket then decodes the new
slots with the old ones; free slots are done and ask for nothing. Each request's random
numbers are keyed by its own seed and positions (runtime/rng.py), so where and when it is
admitted does not change what it samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..models.eagle import DraftHead
from ..models.llama import Llama
from .config import SamplingParams
from .kv_cache import KVCache
from .prefill import allocate_state, prefill, prefill_columns
from .round import SpecState


def admit(
    target: Llama,
    head: DraftHead | None,
    state: SpecState,
    slots: Sequence[int],
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    target_forward: Callable | None = None,
    draft_forward: Callable | None = None,
) -> torch.Tensor:
    """Prefill one request per slot into `slots` of `state`, leaving every other slot as it
    is. The slots must be free (done); the caller checks that prompt + max_new_tokens fit.

    Returns the prefill report [len(slots), 5] int64 (ReportColumns: the root token emitted)
    of the admitted slots, in `slots` order.
    """
    assert len(slots) == len(prompts) == len(params) > 0, (slots, len(prompts), len(params))
    device = state.root.device
    num_columns = prefill_columns(prompts)
    staging = allocate_state(
        target,
        head,
        batch_size=len(slots),
        capacity=num_columns,
        depth=0 if state.pending is None else state.pending.tokens.shape[1] - 1,
    )
    report = prefill(
        target,
        head,
        staging,
        prompts,
        params,
        eos_token_ids,
        target_forward=target_forward,
        draft_forward=draft_forward,
    )
    index = torch.tensor(list(slots), dtype=torch.int64).to(device, non_blocking=True)
    _copy_cache(staging.target, state.target, index)
    if state.draft is not None:
        _copy_cache(staging.draft, state.draft, index)
        for name in ("tokens", "features", "num_valid"):
            getattr(state.pending, name)[index] = getattr(staging.pending, name)
    for name in ("root", "num_output", "max_new", "stop_mask", "done", "finish"):
        getattr(state, name)[index] = getattr(staging, name)
    for name in ("temperature", "top_k", "top_p", "seed"):
        getattr(state.sampling, name)[index] = getattr(staging.sampling, name)
    state.output[index] = 0
    state.output[index, :num_columns] = staging.output
    return report


def _copy_cache(source: KVCache, dest: KVCache, index: torch.Tensor) -> None:
    """The staging cache's positions (all of them: at most the padded prompt) into `index`'s
    slots of `dest`; positions past each slot's length are never attended to."""
    num_positions = source.k.shape[3]
    dest.k[:, index, :, :num_positions] = source.k
    dest.v[:, index, :, :num_positions] = source.v
    dest.lengths[index] = source.lengths
