"""The Engine: load a model (and a draft head), turn requests into token ids, decode, turn ids
back into text.

With a draft head, decoding is speculative (`runtime/speculative.py`, eager rounds for now; the
CUDA-graph runner of issue #5 will replay the same round); without one it is plain
autoregressive decoding (`runtime/reference.py`). Request validation and outputs are the
public contract both paths keep.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.default import default_model_dir
from ..models.eagle import DraftHead
from ..models.llama import Llama
from ..models.loading import load_draft, load_target
from ..models.tokenizer import Tokenizer
from .config import EngineConfig, SamplingParams, validate_prompt_ids
from .reference import reference_stream
from .speculative import RequestStats, SpecStats, speculative_stream

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Step = list[tuple[list[int], str | None]]


@dataclass
class Output:
    """One finished request: text, generated ids (a final stop token included), why it ended,
    and, for speculative decoding, its rounds and accepted tokens."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    seconds: float
    stats: RequestStats | None = None


@dataclass
class EngineStats:
    """Totals since the engine was built (decode time includes the prefill)."""

    num_requests: int = 0
    num_generated_tokens: int = 0
    decode_seconds: float = 0.0
    num_rounds: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per slot-round under speculation (0 without a draft head)."""
        return SpecStats(accepted_histogram=self.accepted_histogram).mean_accepted_length


class Engine:
    """Text in, text out. Build with `Engine.from_pretrained`."""

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        head: DraftHead | None = None,
    ) -> None:
        self.model = model
        self.head = head
        self.tokenizer = tokenizer
        self.config = config
        self._stats = EngineStats()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path | None = None,
        *,
        draft: str | Path | None = None,
        config: EngineConfig | None = None,
    ) -> Engine:
        """Load an HF Llama directory (None: the embedded SmolLM2-135M-Instruct) and, when
        given, an EAGLE draft-head directory for speculative decoding."""
        config = config or EngineConfig()
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        device, dtype = config.resolved_device(), config.resolved_dtype()
        started = time.perf_counter()
        model = load_target(model_dir, dtype=dtype, device=device)
        head = load_draft(draft, target=model) if draft is not None else None
        logger.info("loaded %s in %.1f s", model_dir, time.perf_counter() - started)
        return cls(model, Tokenizer.from_dir(model_dir), config, head=head)

    def stats(self) -> EngineStats:
        """A snapshot of the running totals."""
        return dataclasses.replace(
            self._stats, accepted_histogram=list(self._stats.accepted_histogram)
        )

    def encode_prompt(self, prompt: Prompt, *, index: int = 0) -> list[int]:
        """Token ids of a prompt: strings get the chat template when the config asks for it."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"prompt {index} is empty; give some text")
            if self.config.chat_template and self.tokenizer.has_chat_template:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = validate_prompt_ids(prompt, vocab_size=self.model.config.vocab_size, index=index)
        limit = self.model.config.max_position_embeddings
        if len(ids) >= limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; this model's context is {limit} tokens, "
                "shorten the prompt"
            )
        return ids

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[Output]:
        """Decode a batch of prompts (strings or token-id lists) to completion."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        encoded = [self.encode_prompt(p, index=i) for i, p in enumerate(prompts)]
        token_ids: list[list[int]] = [[] for _ in encoded]
        finish = ["length"] * len(encoded)
        started = time.perf_counter()
        spec_stats = SpecStats()
        with torch.inference_mode():
            for step in self._steps(encoded, params, spec_stats):
                for slot, (tokens, reason) in enumerate(step):
                    token_ids[slot].extend(tokens)
                    finish[slot] = reason or finish[slot]
        seconds = time.perf_counter() - started
        self._record(len(encoded), sum(map(len, token_ids)), seconds, spec_stats)
        per_request = spec_stats.per_request or [None] * len(encoded)
        return [
            Output(
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                token_ids=ids,
                prompt_token_ids=prompt,
                finish_reason=reason,
                seconds=seconds,
                stats=request_stats,
            )
            for prompt, ids, reason, request_stats in zip(
                encoded, token_ids, finish, per_request, strict=True
            )
        ]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens are decoded."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        num_tokens, started = 0, time.perf_counter()
        spec_stats = SpecStats()
        with torch.inference_mode():
            for [(tokens, _reason)] in self._steps([ids], params, spec_stats):
                num_tokens += len(tokens)
                delta = decoder.extend(tokens)
                if delta:
                    yield delta
        self._record(1, num_tokens, time.perf_counter() - started, spec_stats)
        tail = decoder.flush()
        if tail:
            yield tail

    def close(self) -> None:
        """Release the models' memory."""
        self.model = None
        self.head = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _steps(
        self, encoded: list[list[int]], params: SamplingParams, spec_stats: SpecStats
    ) -> Iterator[Step]:
        """(new tokens, finish reason) per slot, step by step, from the configured decoder."""
        eos = self.tokenizer.eos_token_ids
        if self.head is not None:
            yield from speculative_stream(
                self.model,
                self.head,
                encoded,
                params,
                shape=self.config.tree,
                eos_token_ids=eos,
                stats=spec_stats,
            )
            return
        for step in reference_stream(self.model, encoded, params, eos_token_ids=eos):
            yield [([] if token is None else [token], reason) for token, reason in step]

    def _record(
        self, num_requests: int, num_tokens: int, seconds: float, spec_stats: SpecStats
    ) -> None:
        totals = self._stats
        totals.num_requests += num_requests
        totals.num_generated_tokens += num_tokens
        totals.decode_seconds += seconds
        totals.num_rounds += spec_stats.num_rounds
        totals.prefill_seconds += spec_stats.prefill_seconds
        totals.draft_seconds += spec_stats.draft_seconds
        totals.verify_seconds += spec_stats.verify_seconds
        histogram = spec_stats.accepted_histogram
        if histogram:
            totals.accepted_histogram = [
                a + b
                for a, b in zip(
                    totals.accepted_histogram or [0] * len(histogram), histogram, strict=True
                )
            ]
