"""OpenAI-shaped response bodies: completions, chat completions and their streamed chunks, usage,
log probabilities, the model list, errors; and the server's own /health and /v1/graphs bodies.

These are the response models of the OpenAPI document (graphguard/server/openapi.py), so a
client or a fuzzer checking responses against it checks them against these.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """Per token; with `echo` the prompt's first token has no logprob (null entries)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's shape of one token's log probability among a prompt's (`prompt_logprobs`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token (null for the first), the token's and its
# alternatives', by token id as a string
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice (null otherwise)
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk of it (then `usage` is usually None)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null where the answer is only tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


def _absent(value: Any) -> bool:
    return value is None


class DeltaFunction(BaseModel):
    name: str | None = Field(default=None, exclude_if=_absent)  # in a call's first delta
    arguments: str = ""  # the next piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first names it (id, type, name), the others add to
    its arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_absent)
    type: Literal["function"] | None = Field(default=None, exclude_if=_absent)
    function: DeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_absent)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "graphguard"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, not_found_error, ... (errors.py)
    param: str | None  # the request field at fault, when there is one
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer, as OpenAI writes it."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "unavailable"]  # "unavailable" (503) while the server shuts down


class GraphsReport(BaseModel):
    """GET /v1/graphs: whether the engine's graphs are on and why; when on, the decode graphs'
    stats (graphguard.core) with the prefill graphs' under `prefill`."""

    model_config = ConfigDict(extra="allow")

    enabled: bool
    reason: str
    kernels: str  # the decoder's kernel set and why it was chosen ("triton (...)")
    prefill: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    """POST /tokenize, as vLLM answers it."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with `return_token_strs`


class DetokenizeResponse(BaseModel):
    """POST /detokenize, as vLLM answers it."""

    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info: the tokenizer's configuration, as vLLM answers it (special tokens
    as text, each with its id; the chat template; the longest context this server takes)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    name_or_path: str
    model_max_length: int
    chat_template: str | None
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None
