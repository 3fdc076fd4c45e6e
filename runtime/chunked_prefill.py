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

With `max_rows` (on the CPU, `slots.max_prefill_rows`) a chunk runs in pieces of at most
max_rows tokens, and a piece of n tokens runs `prefill_length(n)` rows, target and draft
alike: the prompt's next tokens or zeros past its end, at the positions that follow. They
come after the piece's tokens, so the causal mask hides them from those; only the first n
rows' K/V (the draft's pairs) are appended and their outputs are never read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..models.eagle import DraftHead, DraftOutput
from ..models.llama import AttentionInputs, Llama, ModelOutput
from .config import SamplingParams
from .kv_cache import KVCache
from .prefill import (
    allocate_state,
    emit_root,
    padded_prompts,
    prefill_length,
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
        max_rows: pad each chunk's forwards to `prefill_length`'s rows, running a chunk of
            more tokens than this in pieces of at most this many (see above; a ladder value);
            None: one unpadded forward per chunk.
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
        max_rows: int | None = None,
    ) -> None:
        assert len(prompt) > 0, "a prompt has at least one token"
        self._target = target
        self._head = head
        self._max_rows = max_rows
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
        end = min(self.num_prefilled + max_tokens, self.prompt_length)
        while True:
            start = self.num_prefilled
            stop = end if self._max_rows is None else min(end, start + self._max_rows)
            out, features = self._forwards(start, stop)
            self.num_prefilled = stop
            if stop == end:
                break
        if not self.finished:
            return self._tokens.new_zeros(0, ReportColumns.TOKENS + 1)
        return self._finish(out, features, last=stop - start - 1)

    def _forwards(self, start: int, stop: int) -> tuple[ModelOutput, torch.Tensor | None]:
        """The target and draft over prompt positions start..stop-1 (padded to
        `prefill_length`'s rows with max_rows); returns the target's output and the draft's
        features (None without a head)."""
        num_rows = stop - start if self._max_rows is None else prefill_length(stop - start)
        out = self._target_chunk(start, stop, num_rows)
        if self._head is None:
            return out, None
        features = self._head.target_features(out)
        self._draft_chunk(features, start, stop)
        return out, features

    def _target_chunk(self, start: int, end: int, num_rows: int) -> ModelOutput:
        """The target over `num_rows` rows from prompt position `start`, the first
        end - start of them the chunk's tokens; their K/V appended."""
        out = self._target(
            self._chunk_tokens(start, num_rows),
            self._positions(start, start + num_rows),
            self._attention(self.staging.target, num_rows),
        )
        self._append(self.staging.target, out, end - start)
        return out

    def _draft_chunk(self, features: torch.Tensor, start: int, end: int) -> None:
        """The draft over pairs (token j+1, feature j) for the chunk's positions j below the
        prompt's last (whose next token is the root, drawn after the last chunk), in as many
        rows as the target's (`features` [1, rows, H]); the pairs' K/V appended."""
        num_pairs = min(end, self.prompt_length - 1) - start
        if num_pairs <= 0:
            return
        num_rows = features.shape[1]
        out = self._head(
            self._chunk_tokens(start + 1, num_rows),
            features,
            self._positions(start, start + num_rows),
            self._attention(self.staging.draft, num_rows),
        )
        self._append(self.staging.draft, out, num_pairs)

    def _finish(
        self, out: ModelOutput, features: torch.Tensor | None, *, last: int
    ) -> torch.Tensor:
        """Draw the root from the prompt's last position (row `last` of the last chunk), leave
        (root, last feature) pending, emit the root. Returns the prefill report [1, 7] int64."""
        staging = self.staging
        logits = self._target.logits(out.hidden[:, last])
        staging.root.copy_(draw_tokens(logits, staging.sampling))
        if features is not None:
            set_pending(staging.pending, staging.root, features[:, last])
        return emit_root(staging)

    def _chunk_tokens(self, start: int, num_rows: int) -> torch.Tensor:
        """Prompt tokens [1, num_rows] int64 from position `start`, zeros past the prompt."""
        tokens = self._tokens[:, start : start + num_rows]
        return F.pad(tokens, (0, num_rows - tokens.shape[1]))

    def _append(self, cache: KVCache, out: ModelOutput | DraftOutput, num_tokens: int) -> None:
        """Append the K/V of a chunk's first `num_tokens` rows to `cache`."""
        k_new, v_new = (kv[:, :, :, :num_tokens] for kv in (out.k_new, out.v_new))
        cache.append(k_new, v_new, self._counts(num_tokens))

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
