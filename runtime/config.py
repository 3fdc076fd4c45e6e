"""Frozen, validated configuration objects of the public API.

Every check lives in `__post_init__` and raises ValueError/TypeError saying what to change, so a
bad request is refused at the boundary before it touches any shared state.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .tree import StaticTree, TreeShape

# The batch-1 tree of the published EAGLE-3 Llama-3.1-8B results.
DEFAULT_TREE = TreeShape(depth=7, topk=10, num_nodes=60)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1 = no limit).
    max_new_tokens: generated tokens at most (the stop token included).
    stop_token_ids: extra ids that end the request, besides the model's EOS ids.
    ignore_eos: keep going past EOS (benchmarks); stop_token_ids still apply.
    seed: seeds the sampling generator (a batch shares one generator).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        _check_int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(
            self.stop_token_ids, "__iter__"
        ):
            raise TypeError("stop_token_ids must be a sequence of token ids")
        stop_ids = tuple(self.stop_token_ids)
        for token in stop_ids:
            _check_int("stop_token_ids entry", token)
            if token < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.seed is not None:
            _check_int("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def validate_prompt_ids(prompt: object, *, vocab_size: int, index: int = 0) -> list[int]:
    """Check one tokenized prompt; returns it as a list of ints."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"prompt {index} must be a sequence of token ids, got {type(prompt)}")
    ids = list(prompt)
    if not ids:
        raise ValueError(f"prompt {index} is empty; give at least one token")
    for token in ids:
        _check_int(f"prompt {index} token id", token)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt {index} has token ids outside [0, {vocab_size}): {bad[:8]}; "
            "they must come from this model's tokenizer"
        )
    return ids


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs.

    device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16" or "float16".
    chat_template: wrap string prompts in the model's chat template as a user message.
    tree: the draft tree used with a draft head: a dynamic TreeShape (depth D, top-k K,
        nodes N) or a StaticTree (fixed paths of child ranks).
    """

    device: str = "auto"
    dtype: str = "auto"
    chat_template: bool = True
    tree: TreeShape | StaticTree = dataclasses.field(default_factory=lambda: DEFAULT_TREE)

    def __post_init__(self) -> None:
        if not isinstance(self.tree, (TreeShape, StaticTree)):
            raise TypeError(
                f"tree must be a TreeShape or StaticTree, got {type(self.tree).__name__}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use 'cpu'")
        return device

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
