"""The generation endpoints: an OpenAI request in, engine outputs out as JSON or SSE events.

Completions and chat differ only in how the prompt is tokenized and how outputs are shaped
(`CompletionFormat` / `ChatFormat`); admission, streaming, disconnects and metrics are shared.
"""

from __future__ import annotations

import asyncio
import codecs
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
# token of an echoed prompt, which has no context), and whether it is a prompt token.
_Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None, bool]


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
        self._texts = TokenTexts(tokenizer, echo_text or "")  # offsets run across chunks

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
            (i, None, None, True) if lp is None else (i, lp.logprob, lp.top, True)
            for i, lp in zip(self._prompt_ids, lps, strict=True)
        ]
        return text, entries

    def _logprobs(self, entries: list[_Entry]) -> p.CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        logprobs = p.CompletionLogprobs(
            tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[]
        )
        # NOTE: every token has an entry, control tokens too (named by their text): scoring
        # tools index these lists by token position.
        for token_id, logprob, top, is_prompt in entries:
            token, offset = self._texts.add(token_id, is_prompt)
            logprobs.tokens.append(token)
            logprobs.token_logprobs.append(logprob)
            logprobs.text_offset.append(offset)
            if top is None or logprob is None:
                logprobs.top_logprobs.append(None)
            else:  # the alternatives and, as OpenAI's legacy API does, the chosen token
                alternatives = {self._texts.name(i): value for i, value in top}
                alternatives.setdefault(token, logprob)
                logprobs.top_logprobs.append(alternatives)
        return logprobs


def _entries(logprobs: list[TokenLogprob]) -> list[_Entry]:
    return [(lp.token_id, lp.logprob, lp.top, False) for lp in logprobs]


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
                    **self._top_logprob(lp.token_id, lp.logprob).model_dump(),
                    top_logprobs=[self._top_logprob(i, v) for i, v in lp.top],
                )
                for lp in logprobs
                if not self.tokenizer.is_special(lp.token_id)  # not part of the content
            ]
        )

    def _top_logprob(self, token_id: int, logprob: float) -> p.TopLogprob:
        raw = self.tokenizer.token_bytes(token_id)
        return p.TopLogprob(token=token_name(raw), logprob=logprob, bytes=list(raw))


def token_name(raw: bytes) -> str:
    """A token's text; a token that holds only part of a character is written as its bytes,
    `bytes:\\xe6\\x97`, as OpenAI writes them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenTexts:
    """Names and text offsets of a response's tokens, in order: an echoed prompt's (`echo` is
    its returned text), then the completion's. An offset counts the characters of the text
    before the token; bytes of a character split across tokens count with the token that
    completes it. Control tokens of the completion are not in its text (offset unchanged);
    a prompt's are where the echoed text spells them (a prompt string may, an added start
    token is not)."""

    def __init__(self, tokenizer: Tokenizer, echo: str = "") -> None:
        self.tokenizer = tokenizer
        self._echo = echo
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def add(self, token_id: int, is_prompt: bool = False) -> tuple[str, int]:
        """The next token's name and offset."""
        raw = self.tokenizer.token_bytes(token_id)
        offset = self._offset
        if self.tokenizer.is_special(token_id):
            name = raw.decode("utf-8")
            if is_prompt and self._echo.startswith(name, offset):
                self._offset += len(name)
            return name, offset
        chars = self._decoder.decode(raw)
        if is_prompt and chars[:1] == " " and self._echo[offset : offset + 1] != " ":
            chars = chars[1:]  # a decoder that strips the text's leading space (SentencePiece)
        self._offset += len(chars)
        return token_name(raw), offset

    def name(self, token_id: int) -> str:
        return token_name(self.tokenizer.token_bytes(token_id))


OutputFormat = CompletionFormat | ChatFormat


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
    echo_text = None
    if body.echo:
        prompt = body.prompt
        echo_text = (
            prompt
            if isinstance(prompt, str)
            else ctx.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        )
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
