"""`ServingContext`: what the endpoints need from the server, built once per app.

A module of its own so that the endpoint modules (handlers, images) can all depend on it
without depending on each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from graphguard.engine.tokens.tokenizer import Tokenizer
from graphguard.server.errors import APIError
from graphguard.server.metrics import ServerMetrics
from graphguard.server.served import ServedEngine
from graphguard.server.tool_parsers import HERMES, ToolCallFormat

T = TypeVar("T")

# Text up to this many characters is tokenized (or templated) on the event loop: 0.3 ms at
# most with the embedded tokenizer. Longer text goes to a worker thread, so that one long
# prompt does not hold the loop. A hop to a worker and back costs more than short text: the
# worker, then the loop, each wait for the engine thread's step to hand the interpreter lock
# over.
INLINE_TEXT_CHARS = 1024


async def text_work(num_chars: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, work on `num_chars` characters of text: on the loop when they are few,
    else on a worker thread."""
    if num_chars <= INLINE_TEXT_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True)
class ServingContext:
    """What the endpoints need from the server: one per app."""

    engine: ServedEngine
    metrics: ServerMetrics
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    max_pool_tokens: int  # tokens the whole KV pool holds; one request can never exceed it
    # No token spells more characters than this, so a text longer than max_model_len times it
    # cannot fit the context: it is refused before the tokenizer reads it (tokenizing
    # megabytes holds the interpreter for seconds).
    max_token_chars: int
    permissive: bool = False  # unknown request fields ignored (logged), not a 400
    # SamplingParams defaults of the fields a request does not set (the generation config)
    defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # in place of the model's
    tool_format: ToolCallFormat = HERMES  # how the model writes tool calls (--tool-call-parser)
    isolate_prefixes: bool = True  # each API key reuses only its own cached prefixes

    def check_length(self, texts: list[str], param: str) -> None:
        """Refuse texts that cannot fit the context whatever they tokenize to, cheaply."""
        num_chars = sum(len(text) for text in texts)
        most = self.max_model_len * self.max_token_chars
        if num_chars > most:
            message = (
                f"The {param} has {num_chars} characters; this model's maximum context length "
                f"is {self.max_model_len} tokens, which no text of more than {most} characters "
                "fits."
            )
            raise APIError(400, message, param=param, code="context_length_exceeded")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            message = f"The model '{model}' does not exist; this server serves '{self.model_name}'."
            raise APIError(404, message, param="model", code="model_not_found")
