"""Chunked prefill: one long prompt prefilled a chunk at a time between rounds, so that the
requests already decoding keep getting a round every pass of the scheduler while it fills.

`ChunkedPrefill` owns a staging state of its own (batch 1, as many positions as the padded
prompt) that persists across passes. A chunk over prompt positions start..end-1 runs the
target over those tokens, attending to the staging cache (the `start` positions of the
earlier chunks) and causally within the chunk, and appends the chunk's K/V. With a draft
head, the draft then runs over the pairs (token j+1, feature j) of the chunk's positions j
whose next token is in the prompt, attending to the staging draft cache, and appends their
K/V. After the last chunk the root token is drawn from the last position's logits with the
request's sampling tensors (as `prefill_forwards` draws it, so a seeded request samples the
same root), the pair (root, last feature) is left pending and the root is emitted: the
staging state then holds what one whole prefill of the prompt leaves, and `slots.copy_rows`
copies it into the request's slot.

Chunks run the plain modules eagerly, not the compiled prefill steps: those guard on
attending to an empty cache of capacity 1 (runtime/prefill.py), and a chunk attends to a
filled one. Chunk boundaries are host integers, so nothing here reads a tensor on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.eagle import DraftHead
from ..models.llama import AttentionInputs, Llama, ModelOutput
from .config import SamplingParams
from .kv_cache import KVCache
from .prefill import (
    allocate_state,
    emit_root,
    padded_prompts,
    prompt_ancestors,
    reset_requests,
    set_pending,
)
from .round import ReportColumns, SpecState
from .sampling import draw_tokens


class ChunkedPrefill:
    """One request's prompt, prefilled chunk by chunk into `staging` (`run`).

    Args:
        target: the target model.
        head: the draft head (None: plain decoding, no draft cache or pending pairs).
        prompt: the prompt's token ids (at least one).
        params: the request's sampling parameters.
        eos_token_ids: the model's end-of-sequence ids.
        depth: the deepest draft tree of the state the request is installed into: the staging
            state's pending pairs are as wide (depth + 1) as that state's.
    """

    def __init__(
        self,
        target: Llama,
        head: DraftHead | None,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int],
        depth: int,
    ) -> None:
        assert len(prompt) > 0, "a prompt has at least one token"
        self._target = target
        self._head = head
        self.prompt_length = len(prompt)
        self.num_prefilled = 0
        device = target.lm_head.weight.device
        tokens, _ = padded_prompts([prompt], pinned=device.type == "cuda")
        self._tokens = tokens.to(device, non_blocking=True)
        self.staging: SpecState = allocate_state(
            target, head, batch_size=1, capacity=self._tokens.shape[1], depth=depth
        )
        reset_requests(self.staging, [params], eos_token_ids, vocab_size=target.config.vocab_size)

    @property
    def num_remaining(self) -> int:
        """Prompt tokens not prefilled yet."""
        return self.prompt_length - self.num_prefilled

    @property
    def finished(self) -> bool:
        """Whether the last chunk has run (the staging state is ready to install)."""
        return self.num_remaining == 0

    def run(self, max_tokens: int) -> torch.Tensor:
        """Prefill the next chunk: the next `max_tokens` prompt tokens, or the rest.

        Returns the prefill report (ReportColumns): after the last chunk [1, 7] int64 with the
        root token as the one token emitted; before it an empty [0, 7] int64.
        """
        assert not self.finished and max_tokens > 0, (self.num_remaining, max_tokens)
        start = self.num_prefilled
        end = min(start + max_tokens, self.prompt_length)
        out = self._target_chunk(start, end)
        features = None
        if self._head is not None:
            features = self._head.target_features(out)
            self._draft_chunk(features, start, end)
        self.num_prefilled = end
        if not self.finished:
            return self._tokens.new_zeros(0, ReportColumns.TOKENS + 1)
        return self._finish(out, features)

    def _target_chunk(self, start: int, end: int) -> ModelOutput:
        """The target over prompt positions start..end-1; their K/V appended."""
        out = self._target(
            self._tokens[:, start:end],
            self._positions(start, end),
            self._attention(self.staging.target, end - start),
        )
        self.staging.target.append(out.k_new, out.v_new, self._counts(end - start))
        return out

    def _draft_chunk(self, features: torch.Tensor, start: int, end: int) -> None:
        """The draft over pairs (token j+1, feature j) for the chunk's positions j below the
        prompt's last (whose next token is the root, drawn after the last chunk)."""
        num_pairs = min(end, self.prompt_length - 1) - start
        if num_pairs <= 0:
            return
        out = self._head(
            self._tokens[:, start + 1 : start + 1 + num_pairs],
            features[:, :num_pairs],
            self._positions(start, start + num_pairs),
            self._attention(self.staging.draft, num_pairs),
        )
        self.staging.draft.append(out.k_new, out.v_new, self._counts(num_pairs))

    def _finish(self, out: ModelOutput, features: torch.Tensor | None) -> torch.Tensor:
        """Draw the root from the prompt's last position, leave (root, last feature) pending,
        emit the root. Returns the prefill report [1, 7] int64."""
        staging = self.staging
        logits = self._target.logits(out.hidden[:, -1])
        staging.root.copy_(draw_tokens(logits, staging.sampling))
        if features is not None:
            set_pending(staging.pending, staging.root, features[:, -1])
        return emit_root(staging)

    def _positions(self, start: int, end: int) -> torch.Tensor:
        """Positions [1, end - start] int64: start..end-1."""
        return torch.arange(start, end, device=self._tokens.device)[None]

    def _attention(self, cache: KVCache, num_tokens: int) -> AttentionInputs:
        """Inputs of a chunk of `num_tokens` attending to everything `cache` holds and
        causally to itself."""
        return cache.attention_inputs(prompt_ancestors(1, num_tokens, self._tokens.device))

    def _counts(self, num_tokens: int) -> torch.Tensor:
        """[1] int64 tokens a chunk commits, filled on the device."""
        return torch.full((1,), num_tokens, dtype=torch.int64, device=self._tokens.device)
