"""How prefills run: replayed from CUDA graphs where they fit, else through the compiled (or
eager) prompt forwards; and admissions, prefilled in staging states and copied into free slots
of a running bucket.

A prefill graph is captured per key `(kind, batch, padded length, whether the head runs)`
over static prompt buffers (tokens [B, T], lengths [B]): kind "prefill" for a batch
prefilled into its bucket's state, kind "admit" for requests prefilled into the staging state
of their admission batch (the smallest bucket that holds them) before `slots.copy_rows`
copies their rows into the running bucket's free slots. The head does not run for requests
whose drafts the policy leaves behind from the start (`drafted` False:
RoundPlanner.drafts_prompts), so plain decoding costs what it costs without one; those
graphs are captured by the warm-up where the policy may decline to draft
(`RoundPlanner.skips_drafts`), else on first use.
Lengths are `prefill_length`'s, and a key exists only while batch x length <=
`EngineConfig.prefill_graph_tokens`; longer prefills run the compiled forwards,
whose host work costs 17-39 ms for a 64-token prompt of the embedded model on an H100
against 2-3 ms replayed (BENCHMARKS.md), which every running request would wait for.
Each staging state holds `prefill_graph_tokens // batch` positions.

On the CPU (`max_prefill_rows`) prefills run without graphs but shaped like them: batches and
admissions (into `slots.admit`'s fresh staging state, not a kept one: nothing is captured over
it) are prefilled in groups of a power of two of slots, each padded to `prefill_length` of its
longest prompt and at most CPU_PREFILL_ROWS rows (`slots.prefill_groups`), so every forward
multiplies one of a few row counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from ..models.eagle import DraftHead
from ..models.llama import Llama
from .config import PADDING_PARAMS, EngineConfig, SamplingParams
from .graphs import CudaGraphRunner
from .prefill import (
    allocate_state,
    padded_prompts,
    prefill_forwards,
    prefill_length,
    reset_requests,
)
from .round import SpecState
from .slots import admit, copy_rows, max_prefill_rows, prefill_groups

GraphKey = tuple[str, int, int, bool]


class PrefillRunner:
    """Runs a decoder's prefills and admissions.

    Args:
        target, head: the models (head None: plain decoding everywhere).
        config: max_seq_len and prefill_graph_tokens.
        runner: the decoder's graph runner (None: no CUDA graphs).
        head_for: the head a batch of that bucket prefills with (None where it decodes
            plainly); admissions always prefill the draft too, as the bucket they join may draft.
        depth: the deepest tree of any bucket (the staging states' pending width).
        target_forward, draft_forward: the compiled prompt forwards (None: the modules).
    """

    def __init__(
        self,
        target: Llama,
        head: DraftHead | None,
        config: EngineConfig,
        runner: CudaGraphRunner | None,
        *,
        head_for: Callable[[int], DraftHead | None],
        eos_token_ids: Sequence[int],
        depth: int,
        target_forward: Callable | None,
        draft_forward: Callable | None,
    ) -> None:
        self.target, self.head, self.config = target, head, config
        self._runner = runner
        self._head_for = head_for
        self._eos_token_ids = tuple(eos_token_ids)
        self._depth = depth
        self._forwards = dict(target_forward=target_forward, draft_forward=draft_forward)
        self._max_rows = max_prefill_rows(target.lm_head.weight.device)
        self._prompt_buffers: dict[GraphKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self._staging: dict[int, SpecState] = {}

    def run(
        self, state: SpecState, prompts, params, *, kind: str = "prefill", drafted: bool = True
    ) -> torch.Tensor:
        """Prefill one prompt per slot of `state` (reset first; without `drafted`, the head
        does not run); returns the report [B, 7] int64. Replays the graph of its (kind, batch,
        padded length, drafted) when there is one."""
        key = self.key(state, max(map(len, prompts)), kind=kind, drafted=drafted)
        if key is None:
            head = self._head(kind, len(prompts), drafted=drafted)
            return prefill_groups(
                self.target, head, state, prompts, params, self._eos_token_ids,
                max_rows=self._max_rows, **self._forwards,
            )  # fmt: skip
        vocab_size = self.target.config.vocab_size
        reset_requests(state, params, self._eos_token_ids, vocab_size=vocab_size)
        tokens, lengths = self._prompt_buffers[key]
        host_tokens, host_lengths = padded_prompts(prompts, length=key[2], pinned=True)
        tokens.copy_(host_tokens, non_blocking=True)
        lengths.copy_(host_lengths, non_blocking=True)
        return self._runner.replay(key)

    def key(
        self, state: SpecState, num_tokens: int, *, kind: str = "prefill", drafted: bool = True
    ) -> GraphKey | None:
        """The key of the prefill graph for prompts of at most `num_tokens` in the state's
        batch size (captured now if it is new), or None when such a prefill runs without
        one."""
        batch = state.root.shape[0]
        length = prefill_length(num_tokens, max_length=self.config.max_seq_len)
        if self._runner is None or batch * length > self.config.prefill_graph_tokens:
            return None
        key = (kind, batch, length, self._head(kind, batch, drafted=drafted) is not None)
        if key not in self._runner:
            self._capture(key, state)
        return key

    def admit(
        self,
        state: SpecState,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        drafted: bool = True,
    ) -> torch.Tensor:
        """Prefill new requests into free `slots` of `state`, the others untouched: replaying
        the admission graph of the staging state of the smallest bucket that holds them, or
        (no graphs, or prompts too long for one) `slots.admit` with the compiled forwards
        (on the CPU in padded groups). Without `drafted`, the head does not run. Returns
        their prefill report [len(slots), 7] int64."""
        if self._runner is not None:
            staging = self.staging(self.config.bucket_for(len(slots)))
            key = self.key(staging, max(map(len, prompts)), kind="admit", drafted=drafted)
            if key is not None:
                padding = staging.root.shape[0] - len(slots)
                prompts = [*prompts, *[[0]] * padding]
                params = [*params, *[PADDING_PARAMS] * padding]
                report = self.run(staging, prompts, params, kind="admit", drafted=drafted)
                copy_rows(staging, state, slots, num_positions=key[2])
                return report[: len(slots)]
        return admit(
            self.target, self.head, state, slots, prompts, params, self._eos_token_ids,
            max_rows=self._max_rows, drafted=drafted, **self._forwards,
        )  # fmt: skip

    def staging(self, batch: int) -> SpecState:
        """The admission staging state of `batch` slots."""
        if batch not in self._staging:
            capacity = min(self.config.max_seq_len, self.config.prefill_graph_tokens // batch)
            self._staging[batch] = allocate_state(
                self.target, self.head, batch_size=batch, capacity=max(1, capacity),
                depth=self._depth,
            )  # fmt: skip
        return self._staging[batch]

    def graphs(self, kind: str) -> list[tuple[int, int]]:
        """The (batch, padded prompt length) pairs whose `kind` graphs are captured (with
        the head, or without it where the head does not run)."""
        found = {(batch, length) for k, batch, length, _ in self._prompt_buffers if k == kind}
        return sorted(found)

    def close(self) -> None:
        self._staging.clear()
        self._prompt_buffers.clear()

    def _head(self, kind: str, batch: int, *, drafted: bool) -> DraftHead | None:
        """The head a prefill of `kind` and `batch` slots runs (None: the target alone):
        none unless `drafted`; an admission's always, as the bucket it joins may draft; a
        batch's, its bucket's (`head_for`)."""
        if not drafted:
            return None
        return self.head if kind == "admit" else self._head_for(batch)

    @torch.inference_mode()
    def _capture(self, key: GraphKey, state: SpecState) -> None:
        """Capture the prefill forwards over static prompt buffers of the key's (batch,
        length): full-length zero prompts during the warm-up (whose effects on the state the
        next prefill resets)."""
        kind, batch, length, drafted = key
        device = state.root.device
        tokens = torch.zeros(batch, length, dtype=torch.int64, device=device)
        lengths = torch.full((batch,), length, dtype=torch.int64, device=device)
        self._prompt_buffers[key] = tokens, lengths
        head = self._head(kind, batch, drafted=drafted)
        step = functools.partial(
            prefill_forwards, self.target, head, state, tokens, lengths, **self._forwards
        )
        self._runner.capture(key, step)
