"""OpenAI-shaped request and response bodies.

Requests are validated here, so bad values become a 400 before they reach the engine: NaN and
infinities are refused at parse time, sampling values are range-checked, and `n` must be 1.
OpenAI fields this server does not implement (tools, logit_bias, response_format...)
are accepted at their "off" values, which clients often send, and refused with a 400 otherwise,
so no answer silently lacks what was asked for. Other unknown fields are ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from graphguard.engine.sampling import MAX_LOGPROBS, MAX_PENALTY

MAX_STOP_SEQUENCES = 4  # the OpenAI limit
MAX_CHAT_TOP_LOGPROBS = MAX_LOGPROBS  # the OpenAI limits; the engine's is the chat one
MAX_COMPLETION_LOGPROBS = 5

# Unimplemented OpenAI fields and the values that ask for nothing (None is always accepted).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "suffix": ("",),
    "best_of": (1,),
}


def _asks_for_nothing(value: Any, off_values: tuple[Any, ...]) -> bool:
    # NOTE: compare types too: in Python 0 == False and 1 == True (best_of=True is not 1).
    return value is None or any(type(value) is type(off) and value == off for off in off_values)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with completions' echo
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Extension (as in vLLM): keep generating past end-of-sequence, for fixed-length benchmarks.
    ignore_eos: bool = False
    logit_bias: Any = None
    response_format: Any = None

    @field_validator(*UNSUPPORTED_FIELDS, check_fields=False)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        if not _asks_for_nothing(value, UNSUPPORTED_FIELDS[name]):
            raise ValueError(f"{name} is not supported by this server")
        return value

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got n={n}")
        return n

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """`stop` as a tuple, whether it came as a string, a list or nothing."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is text, a one-element list of text, or token ids."""

    prompt: str | list[str] | list[int]
    # The chosen token's log probability and this many alternatives per generated token.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # The prompt comes back before the completion (with its tokens' logprobs, if asked for).
    echo: bool | None = None
    suffix: Any = None
    best_of: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_non_empty_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = str(prompt[0])
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt  # type: ignore[return-value]  # a list here holds token ids


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str  # only base64 data URLs are accepted (graphguard.engine.images)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def as_template_dict(self, image_text: str = "") -> dict[str, str]:
        """The message as the chat template expects it: plain-text content, each image part
        written as `image_text` (the image placeholder token)."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(
                part.text if isinstance(part, TextPart) else image_text for part in content
            )
        # Chat templates of this model family know "system", not the newer "developer".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # chat has no echo: 0 asks for nothing
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses -------------------------------------------------------------------------------


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk of it (then `usage` is usually None)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
