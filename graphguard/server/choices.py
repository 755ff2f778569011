"""The choices of one HTTP request, each its own engine request, answered together: collected
into one JSON response or streamed as one SSE stream whose chunks carry their choice's index.

Every path out (the last output, an engine failure, a client that hangs up) aborts the choices
still running and records each one's metrics, so no KV block outlives its request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel

from graphguard.engine.engine import RequestOutput
from graphguard.engine.tokens.sampling import TokenLogprob
from graphguard.server import responses as r
from graphguard.server.async_engine import RequestStream
from graphguard.server.context import ServingContext
from graphguard.server.errors import APIError, error_body
from graphguard.server.formatting import ChoiceOutput, OutputFormat
from graphguard.server.metrics import RequestTrace

DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class Choice:
    """Choice `index` of a response: its engine request's stream, trace, and what it has
    produced so far. A choice that `shares_prompt` (a fork, n > 1) counts no prompt tokens:
    its first sibling read the prompt for all of them, and usage counts a prompt once."""

    index: int
    stream: RequestStream
    trace: RequestTrace
    shares_prompt: bool = False
    last: RequestOutput | None = None
    # Logprobs of tokens not yet answered: every one when collecting, those whose text a stream
    # still holds back (stop strings) when streaming.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        # Counted from admission on: a request aborted before its first token read its prompt.
        self.trace.num_prompt_tokens = self._own_prompt_tokens(self.stream.num_prompt_tokens)

    def _own_prompt_tokens(self, num_prompt_tokens: int) -> int:
        return 0 if self.shares_prompt else num_prompt_tokens

    def take(self, output: RequestOutput) -> None:
        num_prompt = self._own_prompt_tokens(output.num_prompt_tokens)
        self.trace.on_output(num_prompt, output.num_output_tokens)
        self.logprobs += output.logprobs or []
        self.prompt_logprobs = self.prompt_logprobs or output.prompt_logprobs
        self.last = output

    def chunk(self, fmt: OutputFormat, output: RequestOutput) -> str | None:
        """The JSON of `output`'s streamed chunk (taken already), with the logprobs held until
        now; None where the format holds its text back."""
        finish_reason = output.finish_reason if output.finished else None
        logprobs, self.logprobs = self.logprobs, []
        return fmt.chunk(
            self.index, output.delta_text, finish_reason, logprobs, self.prompt_logprobs
        )

    def result(self) -> ChoiceOutput:
        if self.last is None:  # a stream always ends with a finished output; never seen
            raise APIError(500, "The engine ended the request without output.")
        return ChoiceOutput(self.last, self.logprobs, self.prompt_logprobs)


async def collect(
    ctx: ServingContext, http_request: Request, choices: list[Choice]
) -> list[ChoiceOutput]:
    """Every choice's whole answer, in index order; a client that hangs up first aborts them."""
    watcher = asyncio.create_task(_abort_on_disconnect(ctx, http_request, choices))
    try:
        async with aclosing(merged_outputs(choices)) as outputs:
            async for choice, output in outputs:
                choice.take(output)
        return [choice.result() for choice in choices]
    finally:
        watcher.cancel()
        _release(ctx, choices)


async def sse_events(
    ctx: ServingContext, choices: list[Choice], fmt: OutputFormat, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: chunks as the choices produce them, each choice's last one with its
    finish_reason, the usage summed over choices if asked for, then `[DONE]` once.

    What ends the stream (the last choice's last chunk, the usage, `[DONE]`) goes out as one
    piece: one write to the socket instead of three (two without the usage), at the moment a
    whole batch of streams ends together."""
    ending = ""
    num_running = len(choices)
    try:
        for opening in fmt.opening():
            yield _sse(opening)
        async with aclosing(merged_outputs(choices)) as outputs:
            async for choice, output in outputs:
                choice.take(output)
                num_running -= output.finished
                chunk = choice.chunk(fmt, output) if output.delta_text or output.finished else None
                if chunk is None:
                    continue
                if num_running:
                    yield _event(chunk)
                else:
                    ending = _event(chunk)
        if include_usage:
            ending += _sse(fmt.usage_chunk(usage(choices)))
    except Exception as exc:  # the engine failed mid-stream: say so in-band, then end
        error = APIError(500, f"Generation failed: {exc}", error_type="server_error")
        ending += _event(json.dumps(error_body(error)))
    finally:
        # NOTE: runs on cancellation too, which is how a client disconnect arrives here.
        _release(ctx, choices)
    yield ending + DONE_EVENT


async def merged_outputs(
    choices: list[Choice],
) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    """Every choice's outputs as they arrive (each choice's in order) until all have finished;
    an engine failure in any one is raised. Close it (`aclosing`) to stop its readers.

    NOTE: one choice (n = 1, nearly every request) is read straight from its stream: a reader
    task and a second queue cost the event loop a task switch and two queue operations per
    token, on the thread that shares the GIL with the engine's steps."""
    if len(choices) == 1:
        (choice,) = choices
        async for output in choice.stream:
            yield choice, output
        return
    arrivals: asyncio.Queue[tuple[Choice, RequestOutput | Exception | None]] = asyncio.Queue()
    readers = [asyncio.create_task(_read(choice, arrivals)) for choice in choices]
    try:
        num_running = len(choices)
        while num_running:
            choice, item = await arrivals.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                num_running -= 1
            else:
                yield choice, item
    finally:
        for reader in readers:
            reader.cancel()


async def _read(
    choice: Choice, arrivals: asyncio.Queue[tuple[Choice, RequestOutput | Exception | None]]
) -> None:
    """Forward one stream's outputs to `arrivals`, then None (its end) or its failure."""
    try:
        async for output in choice.stream:
            arrivals.put_nowait((choice, output))
    except Exception as exc:  # noqa: BLE001 - re-raised by merged_outputs
        arrivals.put_nowait((choice, exc))
        return
    arrivals.put_nowait((choice, None))


async def _abort_on_disconnect(
    ctx: ServingContext, http_request: Request, choices: list[Choice]
) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
    for choice in choices:
        ctx.engine.abort(choice.stream.request_id)


def _release(ctx: ServingContext, choices: list[Choice]) -> None:
    """Abort the choices still running (freeing their KV blocks); record each one's metrics."""
    for choice in choices:
        if not choice.stream.is_finished:
            ctx.engine.abort(choice.stream.request_id)
        ctx.metrics.record_request(choice.trace)


def usage(choices: list[Choice]) -> r.Usage:
    """Token counts summed over the choices, each prompt counted once."""
    num_prompt = sum(choice.trace.num_prompt_tokens for choice in choices)
    num_output = sum(choice.trace.num_output_tokens for choice in choices)
    return r.Usage(
        prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output
    )


def _sse(chunk: BaseModel) -> str:
    return _event(chunk.model_dump_json())


def _event(chunk_json: str) -> str:
    return f"data: {chunk_json}\n\n"
