"""OpenAI-shaped request bodies (the responses are in graphguard.server.responses).

Requests are validated here, so bad values become a 400 before they reach the engine: NaN and
infinities are refused at parse time, sampling values and `logit_bias` are range-checked, and
`response_format` is one of OpenAI's shapes (its schema is compiled later, still a 400).
Types are strict where the OpenAI API's are: integers and booleans must be JSON integers and
booleans (`max_tokens: true` and `stream: "yes"` are refused), numbers may be integers or
floats; text must be valid Unicode (no lone UTF-16 surrogates, which JSON escapes can carry).
OpenAI fields this server does not implement (tools, functions, suffix...)
are accepted at their "off" values, which clients often send, and refused with a 400 otherwise,
so no answer silently lacks what was asked for. Other unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from graphguard.engine.tokens.sampling import MAX_LOGPROBS, MAX_PENALTY
from graphguard.engine.tokens.structured import ResponseFormat
from graphguard.server.constraints import (
    ResponseFormatBody,
    checked_logit_bias,
    engine_response_format,
)

MAX_STOP_SEQUENCES = 4  # the OpenAI limit
MAX_CHAT_TOP_LOGPROBS = MAX_LOGPROBS  # the OpenAI limits; the engine's is the chat one
MAX_COMPLETION_LOGPROBS = 5
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1  # a signed 64-bit integer, as OpenAI's seed is
# Prompts one /v1/completions request may carry, each its own engine request and choice; room
# for evaluation harnesses' batches (lm-eval's `batch_size`) without one request flooding the queue.
MAX_PROMPTS_PER_REQUEST = 64
# Choices one request may ask for: prompts times `n` (each choice is an engine request).
MAX_CHOICES_PER_REQUEST = MAX_PROMPTS_PER_REQUEST

Prompt = str | list[int]  # one completions prompt: text, or token ids
_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
_Batch = Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
# What `prompt` accepts, as the OpenAPI document states it (`completion_prompts` checks it).
PromptInput = (
    _Text | _TokenIds | Annotated[list[_Text], _Batch] | Annotated[list[_TokenIds], _Batch]
)

# Unimplemented OpenAI fields and the values that ask for nothing (None is always accepted).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "best_of": (1,),
}


def _asks_for_nothing(value: Any, off_values: tuple[Any, ...]) -> bool:
    # NOTE: compare types too: in Python 0 == False and 1 == True (best_of=True is not 1).
    return value is None or any(type(value) is type(off) and value == off for off in off_values)


def valid_unicode(text: str) -> str:
    """`text`, if it encodes as UTF-8: a lone surrogate (JSON `"\\ud800"`) does not, and would
    fail later in the tokenizer or while writing a response."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text holds a lone UTF-16 surrogate at index {exc.start}") from None
    return text


def _valid_texts(value: str | list[Any] | None) -> None:
    for text in [value] if isinstance(value, str) else value or []:
        if isinstance(text, str):
            valid_unicode(text)


def _is_token_ids(value: Any) -> bool:
    # NOTE: `type(t) is int`: JSON true and false arrive as bool, a subclass of int.
    return isinstance(value, list) and all(type(t) is int for t in value)


def completion_prompts(prompt: Any) -> list[Prompt]:
    """The prompts a completions `prompt` holds, in order: text or a list of token ids is one
    prompt, a list of texts or of token-id lists one per item. ValueError for an empty list or
    prompt, a list that mixes the kinds, more than MAX_PROMPTS_PER_REQUEST prompts, or text
    that is not valid Unicode. (Token ids are checked against the vocabulary by the handler.)"""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)
    ):
        prompts = prompt
    else:
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (integers), with no mixing of strings and token ids"
        )
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise ValueError(
            f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompts)}"
        )
    for index, one in enumerate(prompts):
        _check_prompt(one, f"prompt {index}" if len(prompts) > 1 else "prompt")
    return prompts


def _check_prompt(prompt: Prompt, where: str) -> None:
    if not prompt:
        raise ValueError(f"{where} must not be empty")
    if isinstance(prompt, str):
        try:
            valid_unicode(prompt)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _GenerationRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0 only with completions' echo
    # Below the engine's GREEDY_BELOW_TEMPERATURE a temperature is greedy, so every one is usable.
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES_PER_REQUEST)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Extension (as in vLLM): keep generating past end-of-sequence, for fixed-length benchmarks.
    ignore_eos: StrictBool = False
    logit_bias: Annotated[dict[str, StrictFloat] | None, AfterValidator(checked_logit_bias)] = None
    response_format: ResponseFormatBody | None = None

    @field_validator(*UNSUPPORTED_FIELDS, check_fields=False)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        if not _asks_for_nothing(value, UNSUPPORTED_FIELDS[name]):
            raise ValueError(f"{name} is not supported by this server")
        return value

    @field_validator("model", "stop")
    @classmethod
    def _valid_unicode(cls, value: str | list[str] | None) -> str | list[str] | None:
        _valid_texts(value)
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_keeps_a_token(cls, top_p: float | None) -> float | None:
        # NOTE: the sampler compares cumulative probabilities with top_p in float32, where a
        # top_p this small is 0 and would keep no token at all.
        if top_p is not None and float(np.float32(top_p)) == 0.0:
            raise ValueError(f"top_p {top_p!r} is 0 in float32 and would keep no token")
        return top_p

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
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as the engine takes it: (token id, bias) pairs."""
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

    @property
    def engine_response_format(self) -> ResponseFormat | None:
        return engine_response_format(self.response_format)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is what OpenAI accepts: text, token ids, or a list of
    either (one choice each); validated, it is always the list of prompts."""

    prompt: Annotated[
        list[Prompt], BeforeValidator(completion_prompts, json_schema_input_type=PromptInput)
    ]
    # The chosen token's log probability and this many alternatives per generated token.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # The prompt comes back before the completion (with its tokens' logprobs, if asked for).
    echo: StrictBool | None = None
    suffix: Any = None
    best_of: Any = None


class TextPart(_Body):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _valid_unicode(cls, text: str) -> str:
        return valid_unicode(text)


class ImageURL(_Body):
    url: str  # only base64 data URLs are accepted (graphguard.engine.models.images)
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("url")
    @classmethod
    def _valid_unicode(cls, url: str) -> str:
        return valid_unicode(url)


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _valid_unicode(cls, content: str | list[Any] | None) -> str | list[Any] | None:
        _valid_texts(content)  # the parts' texts are checked by TextPart
        return content

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
    max_tokens: StrictInt | None = Field(default=None, ge=1)  # no echo: 0 asks for nothing
    # The newer name of max_tokens; both may be sent, but only with the same value.
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees_with_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        max_tokens = info.data.get("max_tokens")
        if None not in (value, max_tokens) and value != max_tokens:
            raise ValueError(
                f"max_completion_tokens ({value}) and max_tokens ({max_tokens}) disagree; "
                "send one of them, or both with the same value"
            )
        return value

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
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
