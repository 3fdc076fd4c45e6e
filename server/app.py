"""The OpenAI-compatible routes: /v1/completions and /v1/chat/completions (streamed as
server-sent events or not), /v1/models, /health, /metrics.

A request is validated (protocol.py), encoded and submitted before the response starts, so
every refusal is a 4xx/503 with OpenAI's error body and nothing reaches the engine. Each of
the `n` choices of each prompt is a request of its own in the engine, all submitted together
(a refusal of one cancels the others); a streamed response interleaves the choices' chunks
as they come, each with its index (streams.merged). A streamed response ends its requests
when the client disconnects (the stream's generator is closed, which cancels them). Stop
strings are matched here, on the text, and cut exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..runtime.async_engine import AsyncEngine, AsyncRequest
from ..runtime.config import SamplingParams
from ..runtime.handle import EngineClosedError, EngineOverloadedError
from . import streams
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling, error_body
from .stop_strings import StopStrings

logger = logging.getLogger(__name__)

_DEFAULT_MAX_TOKENS = 256


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, *, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def build_app(engine: AsyncEngine, *, model_name: str) -> FastAPI:
    """The ASGI app serving `engine` under the model id `model_name`."""
    app = FastAPI(title="specrun", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(error_body(message, kind="invalid_request_error", param=param), 400)

    @app.exception_handler(_HTTPError)
    async def _refused(_: Request, error: _HTTPError) -> JSONResponse:
        return JSONResponse(
            error_body(str(error), kind=error.kind, param=error.param), error.status
        )

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specrun"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    def prometheus() -> Response:  # in the thread pool: a scrape waits for a round to end
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        tokenizer = engine.engine.tokenizer
        prompts = [
            tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            for p in body.prompts()
        ]
        return await _respond(body, prompts, max_tokens=body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        tokenizer = engine.engine.tokenizer
        if not tokenizer.has_chat_template:
            raise _HTTPError(400, "this model has no chat template; use /v1/completions",
                             kind="invalid_request_error", param="messages")  # fmt: skip
        text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        ids = tokenizer.encode(text, add_special_tokens=False)
        return await _respond(body, [ids], max_tokens=body.requested_max_tokens(), chat=True)

    async def _respond(
        body: _Sampling, prompts: list[list[int]], *, max_tokens: int | None, chat: bool
    ):
        if body.model and body.model != model_name:
            message = f"model {body.model!r} does not exist; this server serves {model_name!r}"
            raise _HTTPError(404, message, kind="invalid_request_error", param="model")
        arrived = time.perf_counter()
        requests = _submit(engine, body, prompts, max_tokens)
        kind = "chatcmpl" if chat else "cmpl"
        reply_id = f"{kind}-{uuid.uuid4().hex}"
        reply = _Reply(reply_id, model_name, chat=chat, requests=requests, num_choices=body.n)
        events = [_text_events(r, body.stop_strings(), metrics, arrived) for r in requests]
        if body.stream:
            chunks = reply.stream(events, include_usage=body.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await reply.whole(events)

    return app


async def _text_events(
    request: AsyncRequest, stops: list[str], metrics: ServerMetrics, arrived: float
) -> AsyncIterator[tuple[str, str | None]]:
    """(text delta, finish reason on the last) of a request, stop strings applied; observes
    the latency metrics. Closing it early cancels the request."""
    decoder = request.handle._require_tokenizer().stream_decoder(skip_special_tokens=True)
    matcher = StopStrings(stops)
    last = None
    async for delta in request:
        now = time.perf_counter()
        if delta.token_ids:
            if last is None:
                metrics.time_to_first_token.observe(now - arrived)
            else:
                gap = (now - last) / len(delta.token_ids)
                for _ in delta.token_ids:
                    metrics.inter_token_latency.observe(gap)
            last = now
        text, stopped = matcher.feed(decoder.extend(delta.token_ids))
        if stopped:
            request.cancel()
            metrics.request_latency.observe(now - arrived)
            yield text, "stop"
            return
        if delta.finish_reason is not None:
            metrics.request_latency.observe(now - arrived)
            tail, stopped = matcher.feed(decoder.flush())
            yield (
                text + tail + ("" if stopped else matcher.flush()),
                _openai_reason(delta.finish_reason),
            )
            return
        if text:
            yield text, None


def _openai_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _submit(
    engine: AsyncEngine, body: _Sampling, prompts: list[list[int]], max_tokens: int | None
) -> list[AsyncRequest]:
    """Submit a validated body's `n` choices of each prompt, in the order of their indexes;
    the engine's refusals become HTTP errors (after cancelling the choices already
    submitted). Without max_tokens, up to 256 tokens, fewer when the context holds fewer."""
    decoder = engine.engine.decoder
    requests: list[AsyncRequest] = []
    try:
        for ids in prompts:
            room = decoder.config.max_seq_len - len(ids) - 2 * (decoder.max_depth + 1)
            limit = max(1, min(_DEFAULT_MAX_TOKENS, room)) if max_tokens is None else max_tokens
            for _ in range(body.n):
                params = body.sampling_params(max_tokens=limit, choice=len(requests))
                requests.append(_submit_one(engine, ids, params))
        return requests
    except BaseException:
        for request in requests:
            request.cancel()
        raise


def _submit_one(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> AsyncRequest:
    try:
        return engine.submit(ids, params)
    except EngineOverloadedError as e:
        raise _HTTPError(503, str(e), kind="server_overloaded") from None
    except EngineClosedError as e:
        raise _HTTPError(503, str(e), kind="server_shutting_down") from None
    except (ValueError, TypeError) as e:
        raise _HTTPError(400, str(e), kind="invalid_request_error") from None


class _Reply:
    """OpenAI response bodies of one request and its choices."""

    def __init__(
        self,
        reply_id: str,
        model: str,
        *,
        chat: bool,
        requests: Sequence[AsyncRequest],
        num_choices: int,
    ) -> None:
        self.id, self.model, self.chat = reply_id, model, chat
        self.created = int(time.time())
        self._handles = [request.handle for request in requests]
        self._num_choices = num_choices

    async def whole(self, events: Sequence[AsyncIterator[tuple[str, str | None]]]) -> dict:
        try:
            texts = await asyncio.gather(*(_whole_text(e) for e in events))
        finally:
            self._cancel()  # a cancelled reply; no effect on requests that finished
        choices = [
            self._choice(index, text, finish, delta=False)
            for index, (text, finish) in enumerate(texts)
        ]
        return self._body(choices, chunk=False, usage=self._usage())

    async def stream(
        self, events: Sequence[AsyncIterator[tuple[str, str | None]]], *, include_usage: bool
    ) -> AsyncIterator[str]:
        merged = streams.merged(events)
        try:
            if self.chat:
                for index in range(len(events)):
                    first = self._choice(index, None, None, delta=True)
                    first["delta"] = {"role": "assistant", "content": ""}
                    yield _event(self._body([first], chunk=True))
            async for index, (text, reason) in merged:
                if text or reason is not None:
                    choice = self._choice(index, text or None, reason, delta=True)
                    yield _event(self._body([choice], chunk=True))
            if include_usage:
                yield _event(self._body([], chunk=True, usage=self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            await merged.aclose()
            self._cancel()  # a disconnected client, even before the first chunk

    def _cancel(self) -> None:
        for handle in self._handles:
            handle.cancel()

    def _choice(self, index: int, text: str | None, reason: str | None, *, delta: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        if delta:
            content = {} if text is None else {"content": text}
            return {"index": index, "delta": content, "logprobs": None, "finish_reason": reason}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}

    def _body(self, choices: list[dict], *, chunk: bool, usage: dict | None = None) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip
        if usage is not None:
            body["usage"] = usage
        return body

    def _usage(self) -> dict:
        """Each prompt counted once, the completion tokens of every choice."""
        firsts = self._handles[:: self._num_choices]
        num_prompt = sum(len(handle.prompt_token_ids) for handle in firsts)
        num_completion = sum(len(handle.token_ids) for handle in self._handles)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
        }


async def _whole_text(events: AsyncIterator[tuple[str, str | None]]) -> tuple[str, str | None]:
    """A choice's whole text and finish reason."""
    parts, finish = [], None
    async for text, reason in events:
        parts.append(text)
        finish = reason
    return "".join(parts), finish


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
