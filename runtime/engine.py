"""The Engine: load a model, turn requests into token ids, decode, turn ids back into text.

Until the speculative runtime and its CUDA-graph runner land (issues #3 and #5) decoding goes
through `runtime/reference.py`; the request handling, validation and outputs here are the
public contract those paths will keep.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.default import default_model_dir
from ..models.loading import load_target
from ..models.tokenizer import Tokenizer
from .config import EngineConfig, SamplingParams, validate_prompt_ids
from .reference import reference_generate, reference_stream

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class Output:
    """One finished request: text, generated ids (a final stop token included), why it ended."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    seconds: float


@dataclass
class EngineStats:
    """Totals since the engine was built."""

    num_requests: int = 0
    num_generated_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    """Text in, text out. Build with `Engine.from_pretrained`."""

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self._stats = EngineStats()

    def stats(self) -> EngineStats:
        """A snapshot of the running totals."""
        return dataclasses.replace(self._stats)

    def _record(self, *, num_requests: int, num_tokens: int, seconds: float) -> None:
        self._stats.num_requests += num_requests
        self._stats.num_generated_tokens += num_tokens
        self._stats.decode_seconds += seconds

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path | None = None, *, config: EngineConfig | None = None
    ) -> Engine:
        """Load an HF Llama directory; None means the embedded SmolLM2-135M-Instruct."""
        config = config or EngineConfig()
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        device, dtype = config.resolved_device(), config.resolved_dtype()
        started = time.perf_counter()
        model = load_target(model_dir, dtype=dtype, device=device)
        logger.info("loaded %s in %.1f s", model_dir, time.perf_counter() - started)
        return cls(model, Tokenizer.from_dir(model_dir), config)

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
        started = time.perf_counter()
        with torch.inference_mode():
            results = reference_generate(
                self.model, encoded, params, eos_token_ids=self.tokenizer.eos_token_ids
            )
        seconds = time.perf_counter() - started
        num_tokens = sum(len(r.token_ids) for r in results)
        self._record(num_requests=len(results), num_tokens=num_tokens, seconds=seconds)
        return [
            Output(
                text=self.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                token_ids=r.token_ids,
                prompt_token_ids=ids,
                finish_reason=r.finish_reason,
                seconds=seconds,
            )
            for ids, r in zip(encoded, results, strict=True)
        ]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens are decoded."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        num_tokens, started = 0, time.perf_counter()
        with torch.inference_mode():
            steps = reference_stream(
                self.model, [ids], params, eos_token_ids=self.tokenizer.eos_token_ids
            )
            for [(token, _finish)] in steps:
                if token is not None:
                    num_tokens += 1
                    delta = decoder.push(token)
                    if delta:
                        yield delta
        self._record(num_requests=1, num_tokens=num_tokens, seconds=time.perf_counter() - started)
        tail = decoder.flush()
        if tail:
            yield tail

    def close(self) -> None:
        """Release the model's memory."""
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
