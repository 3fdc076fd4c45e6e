"""Request bookkeeping shared by every decoder: validation, stop masks, results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import SamplingParams, validate_prompt_ids

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Generation:
    """One request's result: generated ids (a final stop token included) and why it ended."""

    token_ids: list[int]
    finish_reason: str


def check_requests(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    vocab_size: int,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Validate tokenized prompts and their sampling parameters (one, or one per prompt)."""
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    checked = [
        validate_prompt_ids(p, vocab_size=vocab_size, index=i) for i, p in enumerate(prompts)
    ]
    params = _params_list(params, len(checked))
    for index, p in enumerate(params):
        _check_fits_vocabulary(p, index, vocab_size=vocab_size)
    return checked, params


def _params_list(params: object, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams for every prompt, or a list with one per prompt."""
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if params is SamplingParams:
        raise TypeError("params must be a SamplingParams instance, e.g. SamplingParams(), "
                        "not the class")  # fmt: skip
    if not isinstance(params, (list, tuple)):
        raise TypeError(
            "params must be one SamplingParams or a list with one per prompt, got "
            f"{type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise ValueError(
            f"got {len(params)} SamplingParams for {num_prompts} prompts; pass one for all "
            "prompts or exactly one per prompt"
        )
    for index, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{index}] must be a SamplingParams, got {type(p).__name__}")
    return list(params)


def _check_fits_vocabulary(p: SamplingParams, index: int, *, vocab_size: int) -> None:
    if p.top_k > vocab_size:
        raise ValueError(
            f"request {index}: top_k={p.top_k} is more than the model's {vocab_size} tokens; "
            "use at most that, or 0 for no limit"
        )
    outside = [t for t in p.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(
            f"request {index}: stop_token_ids {outside[:8]} are outside the model's "
            f"vocabulary [0, {vocab_size}); use ids from this model's tokenizer"
        )


def stop_mask(
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[int],
    *,
    vocab_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """[B, V] bool: token t ends slot b (EOS unless ignore_eos, plus the stop ids)."""
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for slot, p in enumerate(params):
        mask[slot, stop_ids(p, eos_token_ids, vocab_size=vocab_size)] = True
    return mask.to(device)


def stop_ids(p: SamplingParams, eos_token_ids: Sequence[int], *, vocab_size: int) -> list[int]:
    """The ids in the vocabulary that end a request, ascending: its stop ids, and EOS unless
    ignore_eos."""
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return sorted(t for t in ids if t < vocab_size)
