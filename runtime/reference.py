"""Plain autoregressive decoding with a static KV cache: the oracle for every fast path.

A ragged batch is right-padded and prefilled in one forward (a causal chain per slot); then one
token per slot per step. Finished slots keep stepping harmlessly until the whole batch is done.
This file favours obviousness over speed: it may read tensors on the host between steps. Its
draws are keyed by seed and output position as the fast paths' are (runtime/rng.py), so a
seeded request samples here exactly what it samples there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..models.attention import chain_ancestors
from ..models.llama import Llama
from .config import SamplingParams
from .kv_cache import KVCache
from .requests import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    check_requests,
    stop_mask,
)
from .sampling import SamplingTensors, draw_tokens


def reference_generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    eos_token_ids: Sequence[int] = (),
) -> list[Generation]:
    """Decode a batch of tokenized prompts to completion (see `reference_stream`)."""
    results: list[Generation] = []
    for step in reference_stream(model, prompts, params, eos_token_ids=eos_token_ids):
        if not results:
            results = [Generation([], FINISH_LENGTH) for _ in step]
        for result, (token, finish) in zip(results, step, strict=True):
            if token is not None:
                result.token_ids.append(token)
            if finish is not None:
                result.finish_reason = finish
    return results or [Generation([], FINISH_LENGTH) for _ in prompts]


def reference_stream(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    eos_token_ids: Sequence[int] = (),
) -> Iterator[list[tuple[int | None, str | None]]]:
    """Yield, per decoding step, (new token or None, finish reason or None) for every slot.

    A slot yields a token until it finishes (the step that finishes it carries the reason) and
    (None, None) afterwards. Nothing is yielded when every request has max_new_tokens == 0.
    """
    prompts, params = check_requests(prompts, params, vocab_size=model.config.vocab_size)
    device = model.lm_head.weight.device
    max_new = torch.tensor([p.max_new_tokens for p in params], device=device)
    num_steps = int(max_new.max())
    if num_steps == 0:
        return
    sampling = SamplingTensors.from_params(params, device)
    stops = stop_mask(params, eos_token_ids, vocab_size=model.config.vocab_size, device=device)
    cache = _prefill_cache(model, prompts, capacity=max(map(len, prompts)) + num_steps)
    token = _prefill(model, cache, prompts, sampling)
    done = max_new == 0
    for step in range(num_steps):
        active = ~done
        finished_by_stop = active & stops.gather(1, token[:, None])[:, 0]
        finished_by_length = active & ~finished_by_stop & (max_new == step + 1)
        done = done | finished_by_stop | finished_by_length
        yield _step_report(token, active, finished_by_stop, finished_by_length)
        if bool(done.all()):
            return
        token = _decode_step(model, cache, token, sampling, position=step + 1)


def _prefill_cache(model: Llama, prompts: list[list[int]], *, capacity: int) -> KVCache:
    weight = model.lm_head.weight
    return KVCache.allocate(
        model.config,
        batch_size=len(prompts),
        capacity=capacity,
        dtype=weight.dtype,
        device=weight.device,
    )


def _prefill(
    model: Llama,
    cache: KVCache,
    prompts: list[list[int]],
    sampling: SamplingTensors,
) -> torch.Tensor:
    """Run the right-padded prompts through the model, fill the cache, sample token one
    (output position 0)."""
    device = cache.k.device
    batch, length = len(prompts), max(map(len, prompts))
    tokens = torch.zeros(batch, length, dtype=torch.int64, device=device)
    for slot, prompt in enumerate(prompts):
        tokens[slot, : len(prompt)] = torch.tensor(prompt, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    positions = torch.arange(length, device=device).expand(batch, length)
    out = model(tokens, positions, cache.attention_inputs(chain_ancestors(batch, length, device)))
    cache.append(out.k_new, out.v_new, lengths)
    last_hidden = out.hidden[torch.arange(batch, device=device), lengths - 1]
    return draw_tokens(model.logits(last_hidden), sampling)


def _decode_step(
    model: Llama,
    cache: KVCache,
    token: torch.Tensor,
    sampling: SamplingTensors,
    *,
    position: int,
) -> torch.Tensor:
    """Feed `token`, draw the token of output position `position`."""
    batch = token.shape[0]
    anc = chain_ancestors(batch, 1, token.device)
    out = model(token[:, None], cache.lengths[:, None], cache.attention_inputs(anc))
    cache.append(out.k_new, out.v_new, torch.ones_like(cache.lengths))
    return draw_tokens(model.logits(out.hidden[:, 0]), sampling, position)


def _step_report(
    token: torch.Tensor,
    active: torch.Tensor,
    by_stop: torch.Tensor,
    by_length: torch.Tensor,
) -> list[tuple[int | None, str | None]]:
    report = []
    for tok, is_active, stop, length in zip(
        token.tolist(), active.tolist(), by_stop.tolist(), by_length.tolist(), strict=True
    ):
        finish = FINISH_STOP if stop else FINISH_LENGTH if length else None
        report.append((tok if is_active else None, finish))
    return report
