"""The OpenAI request bodies the server accepts, validated before anything reaches the
engine, and the error body it answers with.

Types are strict (a string where a number belongs is an error, not coerced), unknown fields
are ignored as OpenAI's clients send some we do not use, and options specrun does not
implement (logprobs, penalties, echo) are refused by name rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..runtime.config import SamplingParams

NonNegativeInt = Annotated[int, Field(ge=0)]
# Choices per prompt (`n`) and prompts per completion request: each choice of each prompt
# is a request of its own in the engine.
MAX_CHOICES = 16
MAX_PROMPTS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: NonNegativeInt | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: NonNegativeInt = 0
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError("logprobs are not supported; leave logprobs unset")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (they change the distribution); use 0")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops) or len(stops) > 16:
            raise ValueError("stop must be up to 16 non-empty strings")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, *, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine parameters of the choice of index `choice` (0 to n - 1 for one prompt;
        prompt p's choices are p * n to p * n + n - 1): with a seed, choice i samples from
        seed + i, so every choice differs."""
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            seed=seed,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """POST /v1/completions: prompt is a text or a list of token ids, or a list of several
    (up to MAX_PROMPTS; each gets `n` choices)."""

    prompt: str | list[NonNegativeInt] | list[str] | list[list[NonNegativeInt]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list) -> str | list:
        prompts = _prompt_list(prompt)
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompt is empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request; got {len(prompts)}")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or several."""
        return _prompt_list(self.prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported; leave it false")
        return echo


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (text content only)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: NonNegativeInt | None = None

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


def _prompt_list(prompt: str | list) -> list:
    """One prompt (a text or token ids) as a list of one; a list of several as it is."""
    several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return list(prompt) if several else [prompt]


def error_body(message: str, *, kind: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
