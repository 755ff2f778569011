"""The generation endpoints: an OpenAI request in, engine outputs out as JSON or SSE events.

Completions and chat differ only in how the prompt is tokenized and how outputs are shaped
(`CompletionFormat` / `ChatFormat`); admission, streaming, disconnects and metrics are shared.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from torch import Tensor

from graphguard.engine.engine import RequestOutput
from graphguard.engine.sampling import SamplingParams, TokenLogprob
from graphguard.engine.tokenizer import Tokenizer
from graphguard.server import protocol as p
from graphguard.server.async_engine import AsyncEngine, EngineClosedError, RequestStream
from graphguard.server.errors import APIError, error_body
from graphguard.server.images import chat_prompt
from graphguard.server.metrics import RequestTrace, ServerMetrics

logger = logging.getLogger("graphguard.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DONE_EVENT = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ServingContext:
    """What the endpoints need from the server: one per app."""

    engine: AsyncEngine
    metrics: ServerMetrics
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    max_pool_tokens: int  # tokens the whole KV pool holds; one request can never exceed it

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            message = f"The model '{model}' does not exist; this server serves '{self.model_name}'."
            raise APIError(404, message, param="model", code="model_not_found")


# A token of a completions logprobs list: id, logprob and alternatives (None for the first
# token of an echoed prompt, which has no context).
_Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None]


class CompletionFormat:
    """Shapes outputs as /v1/completions objects; with `echo_text`, the prompt comes first
    (in the first streamed chunk) and, with logprobs, its tokens' entries too."""

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        with_logprobs: bool = False,
        echo_text: str | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.request_id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.tokenizer = tokenizer
        self.with_logprobs = with_logprobs
        self._echo_text = echo_text
        self._prompt_ids = prompt_ids or []
        self._text_offset = 0  # where the next token's text starts in the returned text

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(
        self,
        delta: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> BaseModel:
        echo, entries = self._take_echo(prompt_logprobs)
        choice = p.CompletionChoice(
            text=echo + delta,
            finish_reason=finish_reason,
            logprobs=self._logprobs(entries + _entries(logprobs)),
        )
        return p.CompletionResponse(id=self.request_id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(
        self,
        output: RequestOutput,
        usage: p.Usage,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> BaseModel:
        echo, entries = self._take_echo(prompt_logprobs)
        choice = p.CompletionChoice(
            text=echo + output.text,
            finish_reason=output.finish_reason,
            logprobs=self._logprobs(entries + _entries(logprobs)),
        )
        return p.CompletionResponse(
            id=self.request_id, model=self.model, choices=[choice], usage=usage
        )

    def _take_echo(
        self, prompt_logprobs: list[TokenLogprob | None] | None
    ) -> tuple[str, list[_Entry]]:
        """The echoed prompt and its entries, once (the first chunk); then nothing."""
        if self._echo_text is None:
            return "", []
        text, self._echo_text = self._echo_text, None
        lps = prompt_logprobs or [None] * len(self._prompt_ids)
        entries: list[_Entry] = [
            (i, None, None) if lp is None else (i, lp.logprob, lp.top)
            for i, lp in zip(self._prompt_ids, lps, strict=True)
        ]
        return text, entries

    def _logprobs(self, entries: list[_Entry]) -> p.CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        tokens = [token_text(self.tokenizer, token_id) for token_id, _, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return p.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[logprob for _, logprob, _ in entries],
            top_logprobs=[
                None if top is None else {token_text(self.tokenizer, i): v for i, v in top}
                for _, _, top in entries
            ],
            text_offset=offsets,
        )


def _entries(logprobs: list[TokenLogprob]) -> list[_Entry]:
    return [(lp.token_id, lp.logprob, lp.top) for lp in logprobs]


class ChatFormat:
    """Shapes outputs as /v1/chat/completions objects."""

    def __init__(self, model: str, tokenizer: Tokenizer, with_logprobs: bool = False) -> None:
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.tokenizer = tokenizer
        self.with_logprobs = with_logprobs

    def opening(self) -> list[BaseModel]:
        return [self._chunk(p.ChatDelta(role="assistant", content=""), None, [])]

    def chunk(
        self,
        delta: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,  # chat has no echo
    ) -> BaseModel:
        return self._chunk(p.ChatDelta(content=delta or None), finish_reason, logprobs)

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def response(
        self,
        output: RequestOutput,
        usage: p.Usage,
        logprobs: list[TokenLogprob],
        prompt_logprobs: list[TokenLogprob | None] | None = None,  # chat has no echo
    ) -> BaseModel:
        message = p.AssistantMessage(content=output.text)
        choice = p.ChatChoice(
            message=message, finish_reason=output.finish_reason, logprobs=self._logprobs(logprobs)
        )
        return p.ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=[choice], usage=usage
        )

    def _chunk(
        self, delta: p.ChatDelta, finish_reason: str | None, logprobs: list[TokenLogprob]
    ) -> p.ChatCompletionChunk:
        choice = p.ChatChunkChoice(
            delta=delta,
            finish_reason=finish_reason,
            logprobs=self._logprobs(logprobs) if logprobs else None,
        )
        return p.ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice])

    def _logprobs(self, logprobs: list[TokenLogprob]) -> p.ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        return p.ChatLogprobs(
            content=[
                p.ChatTokenLogprob(
                    **_top_logprob(self.tokenizer, lp.token_id, lp.logprob).model_dump(),
                    top_logprobs=[_top_logprob(self.tokenizer, i, v) for i, v in lp.top],
                )
                for lp in logprobs
            ]
        )


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text as the tokenizer decodes it alone (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> p.TopLogprob:
    token = token_text(tokenizer, token_id)
    return p.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


OutputFormat = CompletionFormat | ChatFormat


async def create_completion(
    ctx: ServingContext, http_request: Request, body: p.CompletionRequest
) -> Response:
    """POST /v1/completions."""
    trace = RequestTrace()
    ctx.check_model(body.model)
    prompt_ids = await _encode_prompt(ctx, body.prompt)
    room = ctx.max_model_len - len(prompt_ids)
    max_tokens = body.max_tokens or min(DEFAULT_COMPLETION_MAX_TOKENS, max(room, 1))
    params = sampling_params(ctx, body, len(prompt_ids), max_tokens, prompt_param="prompt")
    if body.echo and body.logprobs is not None:
        params = replace(params, prompt_logprobs=body.logprobs)
    echo_text = None
    if body.echo:
        prompt = body.prompt
        echo_text = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids)
    fmt = CompletionFormat(
        ctx.model_name, ctx.tokenizer, params.logprobs is not None, echo_text, prompt_ids
    )
    return await _generate(ctx, http_request, body, fmt, prompt_ids, params, trace)


async def create_chat_completion(
    ctx: ServingContext, http_request: Request, body: p.ChatCompletionRequest
) -> Response:
    """POST /v1/chat/completions."""
    trace = RequestTrace()
    ctx.check_model(body.model)
    prompt_ids, images = await chat_prompt(ctx, body)  # image parts decoded and marked
    max_tokens = body.requested_max_tokens
    params = sampling_params(ctx, body, len(prompt_ids), max_tokens, prompt_param="messages")
    fmt = ChatFormat(ctx.model_name, ctx.tokenizer, params.logprobs is not None)
    return await _generate(ctx, http_request, body, fmt, prompt_ids, params, trace, images)


async def _encode_prompt(ctx: ServingContext, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return await asyncio.to_thread(ctx.tokenizer.encode, prompt)
    ids = [int(t) for t in prompt]  # the validator already reduced a list of text to text
    if any(not 0 <= t < ctx.vocab_size for t in ids):
        message = f"Token ids must be in [0, {ctx.vocab_size})."
        raise APIError(400, message, param="prompt", code="invalid_value")
    return ids


def sampling_params(
    ctx: ServingContext,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    num_prompt_tokens: int,
    max_tokens: int | None,
    *,
    prompt_param: str,
) -> SamplingParams:
    """Engine sampling parameters for `body`, refusing requests that cannot fit the context."""
    room = ctx.max_model_len - num_prompt_tokens
    limit = f"This model's maximum context length is {ctx.max_model_len} tokens"
    if room <= 0:
        message = f"{limit}, but the prompt has {num_prompt_tokens} tokens."
        raise APIError(400, message, param=prompt_param, code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        message = (
            f"{limit}; the prompt has {num_prompt_tokens} tokens, so at most {room} "
            f"completion tokens fit, but {max_tokens} were requested."
        )
        raise APIError(400, message, param="max_tokens", code="context_length_exceeded")
    if max_tokens is None:
        # Unbounded requests get the room that both the context and the KV pool leave.
        max_tokens = max(1, min(room, ctx.max_pool_tokens - num_prompt_tokens))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stop_sequences,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logprobs=body.logprobs if isinstance(body, p.CompletionRequest) else body.num_logprobs,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    return params


async def _generate(
    ctx: ServingContext,
    http_request: Request,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    fmt: OutputFormat,
    prompt_ids: list[int],
    params: SamplingParams,
    trace: RequestTrace,
    images: list[Tensor] | None = None,
) -> Response:
    try:
        stream = await ctx.engine.generate(fmt.request_id, prompt_ids, params, images)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_request") from exc
    except EngineClosedError as exc:
        raise APIError(503, str(exc)) from exc
    # Counted from admission on: a request aborted before its first token still read its prompt.
    trace.num_prompt_tokens = stream.num_prompt_tokens
    if body.stream:
        events = _sse_events(ctx, stream, fmt, trace, body.include_usage)
        headers = {"Cache-Control": "no-cache", "X-Request-Id": fmt.request_id}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    output, logprobs, prompt_logprobs = await _collect(ctx, http_request, stream, trace)
    response = fmt.response(output, _usage(trace), logprobs, prompt_logprobs)
    return JSONResponse(response.model_dump())


async def _collect(
    ctx: ServingContext, http_request: Request, stream: RequestStream, trace: RequestTrace
) -> tuple[RequestOutput, list[TokenLogprob], list[TokenLogprob | None] | None]:
    """Wait for the final output (and gather every token's logprobs and the prompt's, if
    asked for), aborting the request if the client hangs up first."""
    watcher = asyncio.create_task(_abort_on_disconnect(ctx, http_request, stream.request_id))
    output: RequestOutput | None = None
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob | None] | None = None
    try:
        async for output in stream:
            trace.on_output(output.num_prompt_tokens, output.num_output_tokens)
            logprobs += output.logprobs or []
            prompt_logprobs = prompt_logprobs or output.prompt_logprobs
        if output is None:  # a stream always ends with a finished output; never seen
            raise APIError(500, "The engine ended the request without output.")
        return output, logprobs, prompt_logprobs
    finally:
        watcher.cancel()
        if not stream.is_finished:
            ctx.engine.abort(stream.request_id)
        ctx.metrics.record_request(trace)


async def _abort_on_disconnect(ctx: ServingContext, http_request: Request, request_id: str) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
    ctx.engine.abort(request_id)


async def _sse_events(
    ctx: ServingContext,
    stream: RequestStream,
    fmt: OutputFormat,
    trace: RequestTrace,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events for one request; a client that disconnects aborts it (finally)."""
    try:
        for chunk in fmt.opening():
            yield _sse(chunk)
        pending: list[TokenLogprob] = []  # tokens whose text is held back (stop strings)
        prompt_logprobs: list[TokenLogprob | None] | None = None
        async for output in stream:
            trace.on_output(output.num_prompt_tokens, output.num_output_tokens)
            pending += output.logprobs or []
            prompt_logprobs = prompt_logprobs or output.prompt_logprobs
            if output.delta_text or output.finished:
                finish_reason = output.finish_reason if output.finished else None
                yield _sse(fmt.chunk(output.delta_text, finish_reason, pending, prompt_logprobs))
                pending = []
        if include_usage:
            yield _sse(fmt.usage_chunk(_usage(trace)))
    except Exception as exc:  # the engine failed mid-stream: say so in-band, then end
        error = APIError(500, f"Generation failed: {exc}", error_type="server_error")
        yield f"data: {json.dumps(error_body(error))}\n\n"
    finally:
        # NOTE: runs on cancellation too, which is how a client disconnect arrives here.
        if not stream.is_finished:
            ctx.engine.abort(stream.request_id)
        ctx.metrics.record_request(trace)
    yield DONE_EVENT


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _usage(trace: RequestTrace) -> p.Usage:
    return p.Usage(
        prompt_tokens=trace.num_prompt_tokens,
        completion_tokens=trace.num_output_tokens,
        total_tokens=trace.num_prompt_tokens + trace.num_output_tokens,
    )
