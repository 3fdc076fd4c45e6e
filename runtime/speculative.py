"""Speculative decoding of one batch with eager rounds: the simplest way to run a target and
a draft head together, used by tests, training and evaluation.

It is the decoder of `runtime/decoder.py` with one bucket the size of the batch, a KV capacity
just large enough for the requests, no compilation and no CUDA graphs; the Engine runs the
same decoder with per-bucket compiled graphs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..models.eagle import DraftHead
from ..models.llama import Llama
from .config import EngineConfig, SamplingParams
from .decoder import Decoder, Step
from .prefill import state_capacity
from .requests import FINISH_LENGTH, Generation, check_requests
from .stats import DecodeStats
from .tree import StaticTree, TreeShape


def speculative_generate(
    target: Llama,
    head: DraftHead,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    shape: TreeShape | StaticTree,
    eos_token_ids: Sequence[int] = (),
    policy: str = "fixed",
) -> tuple[list[Generation], DecodeStats]:
    """Decode a batch of tokenized prompts to completion with draft trees of `shape` (with
    an adaptive `policy`, `shape` and its ladder: runtime/policies/)."""
    stats = DecodeStats()
    results: list[Generation] = []
    steps = speculative_stream(
        target,
        head,
        prompts,
        params,
        shape=shape,
        eos_token_ids=eos_token_ids,
        stats=stats,
        policy=policy,
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
    stats: DecodeStats | None = None,
    policy: str = "fixed",
) -> Iterator[Step]:
    """Yield, after the prefill and after every round, (new tokens, finish reason or None) per
    slot. `stats`, when given, is filled in as the run goes."""
    prompts, params = check_requests(prompts, params, vocab_size=target.config.vocab_size)
    capacity = max(
        state_capacity(len(prompt), p.max_new_tokens, shape.depth)
        for prompt, p in zip(prompts, params, strict=True)
    )
    config = EngineConfig(
        device=str(target.lm_head.weight.device),
        buckets=(len(prompts),),
        trees={len(prompts): shape},
        max_seq_len=capacity,
        compile=False,
        cuda_graphs=False,
        policy=policy,
    )
    decoder = Decoder(target, head, config, eos_token_ids=eos_token_ids)
    yield from decoder.stream(prompts, params, stats=stats)
