"""The generation endpoints: an OpenAI request in, engine outputs out as JSON or SSE events.

Completions and chat differ only in how the prompt is tokenized and how outputs are shaped
(`CompletionFormat` / `ChatFormat`, in graphguard.server.formatting); admission, streaming,
disconnects and metrics are shared.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from torch import Tensor

from graphguard.engine.engine import RequestOutput
from graphguard.engine.sampling import SamplingParams, TokenLogprob
from graphguard.server import protocol as p
from graphguard.server import responses as r
from graphguard.server.async_engine import EngineClosedError, RequestStream
from graphguard.server.context import ServingContext
from graphguard.server.errors import APIError, error_body
from graphguard.server.formatting import ChatFormat, CompletionFormat, OutputFormat
from graphguard.server.images import chat_prompt
from graphguard.server.metrics import RequestTrace

logger = logging.getLogger("graphguard.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DONE_EVENT = "data: [DONE]\n\n"


async def create_completion(
    ctx: ServingContext, http_request: Request, body: p.CompletionRequest
) -> Response:
    """POST /v1/completions."""
    trace = RequestTrace()
    ctx.check_model(body.model)
    prompt_ids = await _encode_prompt(ctx, body.prompt)
    room = ctx.max_model_len - len(prompt_ids)
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max(room, 1))
    if max_tokens == 0 and not body.echo:
        message = "max_tokens must be at least 1 (0 only with echo, to score the prompt)."
        raise APIError(400, message, param="max_tokens", code="invalid_value")
    params = sampling_params(ctx, body, len(prompt_ids), max_tokens, prompt_param="prompt")
    if body.echo and body.logprobs is not None:
        params = replace(params, prompt_logprobs=body.logprobs)
    echo_text = _echo_text(ctx, body.prompt, prompt_ids) if body.echo else None
    fmt = CompletionFormat(
        ctx.model_name, ctx.tokenizer, params.logprobs is not None, echo_text, prompt_ids
    )
    return await _generate(ctx, http_request, body, fmt, prompt_ids, params, trace)


def _echo_text(ctx: ServingContext, prompt: str | list[str] | list[int], ids: list[int]) -> str:
    """The prompt as an echo returns it: the text sent, or the decoded ids (control tokens
    spelled out)."""
    if isinstance(prompt, str):
        return prompt
    return ctx.tokenizer.decode(ids, skip_special_tokens=False)


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
    room = _context_room(ctx, num_prompt_tokens, max_tokens, prompt_param)
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


def _context_room(
    ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str
) -> int:
    """Completion tokens the context leaves after the prompt; a 400 when the prompt, or the
    prompt and `max_tokens`, do not fit."""
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
    return room


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


def _usage(trace: RequestTrace) -> r.Usage:
    return r.Usage(
        prompt_tokens=trace.num_prompt_tokens,
        completion_tokens=trace.num_output_tokens,
        total_tokens=trace.num_prompt_tokens + trace.num_output_tokens,
    )
