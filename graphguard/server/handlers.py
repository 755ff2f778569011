"""The generation endpoints: an OpenAI request in, engine requests out, one per choice.

Completions and chat differ only in how prompts are tokenized and how outputs are shaped
(`CompletionFormat` / `ChatFormat`, in graphguard.server.formatting); admission is shared, and
so are collecting, streaming and disconnects (graphguard.server.choices). A completions request
of several prompts gets one choice per prompt, each its own engine request, batched by the
engine like any others; every prompt is checked before any reaches the engine. With `n` above
1, each prompt gets n choices (index = prompt index * n + j): n engine requests of which the
last n - 1 are forks of the first, sharing its prefill, each with its own seed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from torch import Tensor

from graphguard.engine.tokens.sampling import SamplingParams, fork_seed
from graphguard.engine.tokens.structured import (
    InvalidParamError,
    ResponseFormat,
    check_response_format,
)
from graphguard.engine.tokens.tokenizer import Tokenizer
from graphguard.server import protocol as p
from graphguard.server.async_engine import EngineClosedError, EngineRequest
from graphguard.server.choices import Choice, collect, sse_events, usage
from graphguard.server.context import ServingContext, text_work
from graphguard.server.errors import APIError
from graphguard.server.fields import log_unknown_fields, unknown_fields
from graphguard.server.formatting import (
    ChatFormat,
    CompletionFormat,
    CompletionPrompt,
    OutputFormat,
)
from graphguard.server.images import ChatRendering, chat_prompt
from graphguard.server.metrics import RequestTrace
from graphguard.server.security import key_id
from graphguard.server.tool_calls import ToolUse

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


async def create_completion(
    ctx: ServingContext, http_request: Request, body: p.CompletionRequest
) -> Response:
    """POST /v1/completions: one choice per prompt, in prompt order."""
    check_fields(ctx, body)
    traces = [RequestTrace() for _ in range(len(body.prompt) * body.n)]
    ctx.check_model(body.model)
    if body.requested_max_tokens == 0 and not body.echo:
        param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        message = f"{param} must be at least 1 (0 only with echo, to score the prompt)."
        raise APIError(400, message, param=param, code="invalid_value")
    if len(traces) > p.MAX_CHOICES_PER_REQUEST:
        message = (
            f"{len(body.prompt)} prompts times n={body.n} is {len(traces)} choices; at most "
            f"{p.MAX_CHOICES_PER_REQUEST} fit one request."
        )
        raise APIError(400, message, param="n", code="invalid_value")
    for prompt in body.prompt:  # before any tokenizer runs
        ctx.check_length([prompt] if isinstance(prompt, str) else [], "prompt")
    prompt_ids = await _encode_prompts(ctx, body.prompt)
    params: list[SamplingParams] = []
    for index, ids in enumerate(prompt_ids):
        with _naming_prompt(index, len(prompt_ids)):
            params.append(salted(ctx, http_request, _completion_params(ctx, body, ids)))
    await _check_response_format(body.engine_response_format)
    prompts = [
        CompletionPrompt(ids, _echo_text(ctx, prompt, ids) if body.echo else None)
        for prompt, ids in zip(body.prompt, prompt_ids, strict=True)
        for _ in range(body.n)  # one per choice
    ]
    fmt = CompletionFormat(
        ctx.model_name, ctx.tokenizer, prompts, body.logprobs is not None,
        with_prompt_logprobs=body.prompt_logprobs is not None,
    )  # fmt: skip
    requests = [
        request
        for index, (ids, prompt_params) in enumerate(zip(prompt_ids, params, strict=True))
        for request in choice_requests(fmt.request_id, index, body.n, ids, prompt_params)
    ]
    return await _generate(ctx, http_request, body, fmt, requests, traces)


def choice_requests(
    request_id: str,
    prompt_index: int,
    n: int,
    prompt_ids: list[int],
    params: SamplingParams,
    images: list[Tensor] | None = None,
) -> list[EngineRequest]:
    """The n engine requests of one prompt, choices prompt_index * n to prompt_index * n + n - 1:
    the first prefills the prompt, the others are its forks (one prefill for all). With a
    seed, choice j draws from fork_seed(seed, j): distinct choices, the same on every call."""
    first = prompt_index * n
    requests = [EngineRequest(f"{request_id}-{first}", prompt_ids, params, images)]
    for j in range(1, n):
        seed = None if params.seed is None else fork_seed(params.seed, j)
        requests.append(
            EngineRequest(
                f"{request_id}-{first + j}",
                prompt_ids,
                replace(params, seed=seed),
                fork_of=requests[0].request_id,
            )
        )
    return requests


async def _check_response_format(response_format: ResponseFormat | None) -> None:
    """A 400 naming the field of `response_format` if its grammar cannot be compiled (off the
    event loop: a large schema takes a while)."""
    if response_format is None:
        return
    try:
        await asyncio.to_thread(check_response_format, response_format)
    except InvalidParamError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc


def _completion_params(
    ctx: ServingContext, body: p.CompletionRequest, prompt_ids: list[int]
) -> SamplingParams:
    max_tokens = body.requested_max_tokens
    if max_tokens is None:
        room = ctx.max_model_len - len(prompt_ids)
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max(room, 1))
    params = sampling_params(
        ctx, body, len(prompt_ids), max_tokens, body.engine_response_format, prompt_param="prompt"
    )
    if body.echo and body.logprobs is not None:
        params = replace(params, prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
    return params


@contextmanager
def _naming_prompt(index: int, num_prompts: int) -> Iterator[None]:
    """Errors raised inside name the prompt they are about, when the request has several."""
    try:
        yield
    except APIError as exc:
        if num_prompts == 1:
            raise
        message = f"prompt {index}: {exc.message}"
        raise APIError(exc.status_code, message, param=exc.param, code=exc.code) from exc


def _echo_text(ctx: ServingContext, prompt: p.Prompt, ids: list[int]) -> str:
    """The prompt as an echo returns it: the text sent, or the decoded ids (control tokens
    spelled out)."""
    if isinstance(prompt, str):
        return prompt
    return ctx.tokenizer.decode(ids, skip_special_tokens=False)


def check_fields(ctx: ServingContext, body: BaseModel) -> None:
    """A 400 naming the fields of `body` this server does not know, unless it is permissive
    (then a warning in its log): no answer silently lacks what a request asked for."""
    unknown = unknown_fields(body)
    if not unknown:
        return
    if ctx.permissive:
        log_unknown_fields(unknown, type(body).__name__)
        return
    message = (
        f"Unknown fields: {', '.join(unknown[:8])}{' and more' if len(unknown) > 8 else ''}. "
        "This server refuses what it does not implement (graphguard serve --permissive "
        "ignores unknown fields instead)."
    )
    raise APIError(400, message, param=unknown[0], code="unknown_field")


async def create_chat_completion(
    ctx: ServingContext, http_request: Request, body: p.ChatCompletionRequest
) -> Response:
    """POST /v1/chat/completions."""
    check_fields(ctx, body)
    traces = [RequestTrace() for _ in range(body.n)]
    ctx.check_model(body.model)
    tool_use = ToolUse.of(body.tools, body.tool_choice, ctx.tool_format)
    rendering = ChatRendering(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template=body.chat_template or ctx.chat_template,
        template_kwargs=body.chat_template_kwargs,
        tool_use=tool_use,
        tool_format=ctx.tool_format,
    )
    # images decoded and marked
    prompt_ids, images = await chat_prompt(ctx, body.messages, rendering)
    constraint = (tool_use and tool_use.constraint()) or body.engine_response_format
    params = sampling_params(
        ctx, body, len(prompt_ids), body.requested_max_tokens, constraint, prompt_param="messages"
    )
    params = salted(ctx, http_request, params)
    await _check_response_format(constraint)
    fmt = ChatFormat(
        ctx.model_name, ctx.tokenizer, params.logprobs is not None, body.n,
        with_prompt_logprobs=body.prompt_logprobs is not None, echo=body.echo_text,
        tool_use=tool_use,
    )  # fmt: skip
    requests = choice_requests(fmt.request_id, 0, body.n, prompt_ids, params, images)
    return await _generate(ctx, http_request, body, fmt, requests, traces)


async def _encode_prompts(ctx: ServingContext, prompts: list[p.Prompt]) -> list[list[int]]:
    """Each prompt's token ids: text tokenized (off the event loop when long), ids checked."""
    for index, prompt in enumerate(prompts):
        with _naming_prompt(index, len(prompts)):
            _check_token_ids(ctx, prompt)
    num_chars = sum(len(prompt) for prompt in prompts if isinstance(prompt, str))
    return await text_work(num_chars, _token_ids, ctx.tokenizer, prompts)


def _check_token_ids(ctx: ServingContext, prompt: p.Prompt) -> None:
    if isinstance(prompt, list) and any(not 0 <= t < ctx.vocab_size for t in prompt):
        message = f"Token ids must be in [0, {ctx.vocab_size})."
        raise APIError(400, message, param="prompt", code="invalid_value")


def _token_ids(tokenizer: Tokenizer, prompts: list[p.Prompt]) -> list[list[int]]:
    return [tokenizer.encode(prompt) if isinstance(prompt, str) else prompt for prompt in prompts]


def sampling_params(
    ctx: ServingContext,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    num_prompt_tokens: int,
    max_tokens: int | None,
    response_format: ResponseFormat | None,
    *,
    prompt_param: str,
) -> SamplingParams:
    """Engine sampling parameters for `body` (its output held to `response_format`), refusing
    requests that cannot fit the context."""
    room = _context_room(ctx, num_prompt_tokens, max_tokens, prompt_param)
    if max_tokens is None and "max_tokens" in ctx.defaults:  # the generation config's
        max_tokens = min(ctx.defaults["max_tokens"], room)
    if max_tokens is None:
        # Unbounded requests get the room that both the context and the KV pool leave.
        max_tokens = max(1, min(room, ctx.max_pool_tokens - num_prompt_tokens))
    defaults = ctx.defaults  # the generation config's, for what the request does not set
    given = dict(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
    )  # fmt: skip
    chosen = {k: defaults[k] for k, v in given.items() if v is None and k in defaults}
    chosen.update({k: v for k, v in given.items() if v is not None})
    chosen["top_k"] = max(chosen.get("top_k") or 0, 0)  # vLLM's -1 is off, as 0 is
    params = SamplingParams(
        max_tokens=max_tokens,
        seed=body.seed,
        stop=body.stop_sequences,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logprobs=body.logprobs if isinstance(body, p.CompletionRequest) else body.num_logprobs,
        logit_bias=body.logit_bias_pairs,
        response_format=response_format,
        **chosen,
        **body.sampling_fields(),
    )
    try:
        params.validate()
    except ValueError as exc:
        param = getattr(exc, "param", None)
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc
    _check_vocabulary_ids(ctx, params)
    return params


def salted(ctx: ServingContext, http_request: Request, params: SamplingParams) -> SamplingParams:
    """`params` with the request's API key in its cache salt where the server keeps keys'
    cached prefixes apart (--prefix-cache-isolation key): a key reuses only its own."""
    key = key_id(http_request.scope.get("state", {}))
    if not ctx.isolate_prefixes or key is None:
        return params
    salt = f"key:{key}" + (f"\0{params.cache_salt}" if params.cache_salt else "")
    return replace(params, cache_salt=salt)


def _check_vocabulary_ids(ctx: ServingContext, params: SamplingParams) -> None:
    """A 400 naming the field if `logit_bias`, `stop_token_ids` or `allowed_token_ids` holds
    an id past the vocabulary (all hold ids >= 0 already)."""
    for param, token_ids in [
        ("logit_bias", [token_id for token_id, _ in params.logit_bias]),
        ("stop_token_ids", list(params.stop_token_ids)),
        ("allowed_token_ids", list(params.allowed_token_ids or ())),
    ]:
        if any(token_id >= ctx.vocab_size for token_id in token_ids):
            message = f"{param} must hold token ids in [0, {ctx.vocab_size})."
            raise APIError(400, message, param=param, code="invalid_value")


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
    requests: list[EngineRequest],
    traces: list[RequestTrace],
) -> Response:
    """Admit every choice's request (all or none), then answer them as one response."""
    try:
        streams = await ctx.engine.generate(requests)
    except ValueError as exc:  # InvalidParamError names its parameter
        param = getattr(exc, "param", None)
        raise APIError(400, str(exc), param=param, code="invalid_request") from exc
    except EngineClosedError as exc:
        raise APIError(503, str(exc)) from exc
    choices = [
        Choice(index, stream, trace, shares_prompt=request.fork_of is not None)
        for index, (stream, trace, request) in enumerate(
            zip(streams, traces, requests, strict=True)
        )
    ]
    if body.stream:
        events = sse_events(ctx, choices, fmt, body.include_usage)
        headers = {"Cache-Control": "no-cache", "X-Request-Id": fmt.request_id}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    outputs = await collect(ctx, http_request, choices)
    # pydantic-core's serializer, as the stream's events are written
    body_json = fmt.response(outputs, usage(choices)).model_dump_json()
    return Response(body_json, media_type="application/json")
