"""The Engine: load a model (and a draft head), turn requests into token ids, decode them with
the per-bucket compiled (and on CUDA graph-captured) decoder, turn ids back into text.

With a draft head, buckets that have a draft tree decode speculatively; the others, and every
bucket without a head, decode plainly. Every request is validated here, before any state is
touched, so a bad request is refused with a ValueError/TypeError that says what to change and
never disturbs another.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.default import default_model_dir, resolve_draft
from ..models.eagle import DraftHead
from ..models.llama import Llama
from ..models.loading import load_draft, load_target
from ..models.tokenizer import Tokenizer
from . import aot
from .config import EngineConfig, SamplingParams, default_trees, validate_prompt_ids
from .decoder import BucketWarmup, Decoder, RoundVariant, Step
from .requests import check_requests
from .stats import DecodeStats, RequestStats

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class Output:
    """One finished request: text, generated ids (a final stop token included), why it ended
    ("stop" or "length"), the wall seconds of its batch, and its rounds and accepted tokens."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    seconds: float
    stats: RequestStats


@dataclass
class EngineStats:
    """Totals since the engine was built. decode_seconds is wall time (prefill included);
    prefill_seconds and round_seconds are GPU time on CUDA."""

    num_requests: int = 0
    num_generated_tokens: int = 0
    decode_seconds: float = 0.0
    num_rounds: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per slot-round (1.0 for plain decoding)."""
        return DecodeStats(accepted_histogram=self.accepted_histogram).mean_accepted_length


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
        self.decoder = Decoder(model, head, config, eos_token_ids=tokenizer.eos_token_ids)
        self._stats = EngineStats()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path | None = None,
        *,
        draft: str | Path | bool | None = None,
        config: EngineConfig | None = None,
        artifacts: str | Path | None = None,
    ) -> Engine:
        """Load an HF Llama directory (None: the embedded SmolLM2-135M-Instruct) and an EAGLE
        draft head for speculative decoding.

        draft: a draft-head directory; None (the default) is the shipped head with the
        embedded model and plain decoding with any other model; False decodes plainly.

        config: None for the defaults, with the draft head's recommended trees where its
        directory has them (`config.default_trees`).

        artifacts: a directory written by `specrun compile` for this model, head, config,
        torch and device (else ValueError: what differs, how to rebuild). Its compiled steps
        are loaded and every bucket is warmed up (and captured) from them before returning.
        """
        draft = resolve_draft(model_dir, draft)
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        config = config or EngineConfig(trees=default_trees(draft))
        if artifacts is not None:
            config = aot.artifact_config(config)
        command = dict(model_dir=model_dir, draft=draft, config=config, out=artifacts)
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        device, dtype = config.resolved_device(), config.resolved_dtype()
        started = time.perf_counter()
        model = load_target(model_dir, dtype=dtype, device=device)
        head = load_draft(draft, target=model) if draft is not None else None
        logger.info("loaded %s in %.1f s", model_dir, time.perf_counter() - started)
        engine = cls(model, Tokenizer.from_dir(model_dir), config, head=head)
        if artifacts is not None:
            aot.load_into(engine.decoder, artifacts, rebuild=aot.compile_command(**command))
        return engine

    def warmup(
        self, *, filtered: bool = False, progress: bool = True, prompt_lengths: Sequence[int] = ()
    ) -> dict[tuple[int, RoundVariant], BucketWarmup]:
        """Compile and (on CUDA) capture every bucket's rounds, largest first; idempotent.
        `filtered` also prepares the top-k/top-p variants; `prompt_lengths` (in tokens, see
        `encode_prompt`) also captures the prefill graphs such prompts need. Returns what
        each (bucket, round variant) graph cost. Without it, a graph is prepared the first
        time it is used."""
        return self.decoder.warmup(
            filtered=filtered, progress=progress, prompt_lengths=prompt_lengths
        )

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
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Output]:
        """Decode prompts (strings or token-id lists; one or a list) to completion, with one
        SamplingParams for all or one per prompt. Batches above the largest bucket run in
        chunks when the config queues them."""
        encoded, params = self._requests(prompts, params)
        max_bucket = self.config.buckets[-1]
        outputs: list[Output] = []
        for start in range(0, len(encoded), max_bucket):
            chunk = slice(start, start + max_bucket)
            outputs.extend(self._generate_batch(encoded[chunk], params[chunk]))
        return outputs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens are decoded. The request is validated
        here, so a bad one raises at the call, before the first delta is asked for."""
        [ids], [params] = self._requests([prompt], params)
        return self._stream(ids, params)

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[str]:
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        num_tokens, started = 0, time.perf_counter()
        stats = DecodeStats()
        with torch.inference_mode():
            for [(tokens, _reason)] in self.decoder.stream([ids], [params], stats=stats):
                num_tokens += len(tokens)
                delta = decoder.extend(tokens)
                if delta:
                    yield delta
        self._record(num_tokens, time.perf_counter() - started, stats)
        tail = decoder.flush()
        if tail:
            yield tail

    def close(self) -> None:
        """Release graphs, caches and the models' memory."""
        self.decoder.close()
        self.model = None
        self.head = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Encode and validate every request before anything runs."""
        prompts = _prompt_list(prompts)
        encoded = [self.encode_prompt(p, index=i) for i, p in enumerate(prompts)]
        encoded, params = check_requests(
            encoded,
            SamplingParams() if params is None else params,
            vocab_size=self.model.config.vocab_size,
        )
        max_bucket = self.config.buckets[-1]
        if len(encoded) > max_bucket and not self.config.queue:
            raise ValueError(
                f"{len(encoded)} prompts is more than the largest bucket ({max_bucket}) and "
                "queueing is off; send fewer prompts or use EngineConfig(queue=True)"
            )
        for start in range(0, len(encoded), max_bucket):
            chunk = slice(start, start + max_bucket)
            self.decoder.check_fits(encoded[chunk], params[chunk])
        return encoded, params

    def _generate_batch(
        self, encoded: list[list[int]], params: list[SamplingParams]
    ) -> list[Output]:
        token_ids: list[list[int]] = [[] for _ in encoded]
        finish = ["length"] * len(encoded)
        started = time.perf_counter()
        stats = DecodeStats()
        with torch.inference_mode():
            for step in self.decoder.stream(encoded, params, stats=stats):
                _extend(token_ids, finish, step)
        seconds = time.perf_counter() - started
        self._record(sum(map(len, token_ids)), seconds, stats)
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
                encoded, token_ids, finish, stats.per_request, strict=True
            )
        ]

    def _record(self, num_tokens: int, seconds: float, stats: DecodeStats) -> None:
        totals = self._stats
        totals.num_requests += stats.num_requests
        totals.num_generated_tokens += num_tokens
        totals.decode_seconds += seconds
        totals.num_rounds += stats.num_rounds
        totals.prefill_seconds += stats.prefill_seconds
        totals.round_seconds += stats.round_seconds
        histogram = totals.accepted_histogram
        histogram.extend([0] * (len(stats.accepted_histogram) - len(histogram)))
        for depth, count in enumerate(stats.accepted_histogram):
            histogram[depth] += count


def _prompt_list(prompts: object) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or a list of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got "
            f"{type(prompts).__name__}{_TOLIST_HINT if hasattr(prompts, 'tolist') else ''}"
        )
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    if isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
        return [prompts]
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(
                f"prompt {index} must be a string or a list of token ids, got "
                f"{type(prompt).__name__}{_TOLIST_HINT if hasattr(prompt, 'tolist') else ''}"
            )
    return list(prompts)


_TOLIST_HINT = " (pass token ids as a list of ints: ids.tolist())"


def _extend(token_ids: list[list[int]], finish: list[str], step: Step) -> None:
    for slot, (tokens, reason) in enumerate(step):
        token_ids[slot].extend(tokens)
        finish[slot] = reason or finish[slot]
