"""OpenAI-shaped request bodies (the responses are in graphguard.server.responses).

Requests are validated here, so bad values become a 400 before they reach the engine: NaN and
infinities are refused at parse time, sampling values and `logit_bias` are range-checked, and
`response_format` is one of OpenAI's shapes (its schema is compiled later, still a 400).
Types are strict where the OpenAI API's are: integers must be JSON integers, or numbers with
no fraction (`2.0` is 2, as vLLM takes it; `2.5` is refused), and booleans JSON booleans
(`max_tokens: true` and `stream: "yes"` are refused); numbers may be integers or floats; text
must be valid Unicode (no lone UTF-16 surrogates, which JSON escapes can carry).
OpenAI fields this server does not implement (the deprecated functions, suffix, best_of)
are accepted at their "off" values, which clients often send, and refused with a 400 otherwise,
so no answer silently lacks what was asked for; so is every field this server does not know
(graphguard/server/fields.py), unless it serves with --permissive.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict

from graphguard.engine.tokens.limits import MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_STRINGS
from graphguard.engine.tokens.structured import ResponseFormat
from graphguard.server.constraints import (
    LOGIT_BIAS_SCHEMA,
    ResponseFormatBody,
    checked_logit_bias,
    engine_response_format,
)
from graphguard.server.fields import (
    CHOICES_BOUND,
    INT64_BOUND,
    WHOLE_NUMBER,
    RequestBody,
    TokenId,
    off_value_schema,
    refuse_unless_off,
    valid_texts,
    valid_unicode,
)
from graphguard.server.prompts import (
    MAX_PROMPTS_PER_REQUEST,
    Prompt,
    PromptInput,
    completion_prompts,
)
from graphguard.server.tool_calls import ToolChoice, Tools, check_tools
from graphguard.server.vllm_fields import OUTPUT_CONSTRAINTS, VllmFields

MAX_STOP_SEQUENCES = MAX_STOP_STRINGS  # vLLM has no limit; the engine's bounds the work
MAX_CHAT_TOP_LOGPROBS = MAX_LOGPROBS  # the OpenAI limits; the engine's is the chat one
MAX_COMPLETION_LOGPROBS = 5
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1  # a signed 64-bit integer, as OpenAI's seed is
# The sampler compares top_p in float32, where a double at or below 2**-150 rounds to 0 and
# would keep no token; every larger one keeps at least the likeliest.
MIN_TOP_P_EXCLUSIVE = 2.0**-150
MAX_TOP_K = (1 << 31) - 1  # top_k beyond the vocabulary keeps every token
MAX_STOP_TOKEN_IDS = 256  # each generated token is looked up among them
# Choices one request may ask for: prompts times `n` (each choice is an engine request).
MAX_CHOICES_PER_REQUEST = MAX_PROMPTS_PER_REQUEST

# What `stop` takes (_check_stop), as the OpenAPI document states it.
STOP_SCHEMA: JsonDict = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "maxItems": MAX_STOP_SEQUENCES,
        },
        {"type": "null"},
    ]
}
# `stream_options` (not null) only with `stream: true`, as the document states it.
STREAM_OPTIONS_NEED_A_STREAM: JsonDict = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
# `top_logprobs` above 0 only with `logprobs: true` (chat), as the document states it.
TOP_LOGPROBS_NEED_LOGPROBS: JsonDict = {
    "if": {
        "required": ["top_logprobs"],
        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
    },
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


def continuing_opens_no_turn(*present: str) -> JsonDict:
    """`continue_final_message` only without a generation prompt, as the document states it:
    where `continue_final_message` is true (and the fields `present` are given)."""
    return {
        "if": {
            "required": [*present, "continue_final_message"],
            "properties": {"continue_final_message": {"const": True}},
        },
        "then": {
            "required": ["add_generation_prompt"],
            "properties": {"add_generation_prompt": {"const": False}},
        },
    }


CONTINUING_OPENS_NO_TURN = continuing_opens_no_turn()  # chat's rule
# `tool_choice` "required" or a named function needs tools, and constrains the output alone.
CONSTRAINED_TOOLS: JsonDict = {
    "if": {
        "required": ["tool_choice"],
        "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
    },
    "then": {
        "required": ["tools"],
        "properties": {
            "tools": {"type": "array", "minItems": 1},
            **{name: False for name in OUTPUT_CONSTRAINTS},
        },
    },
}
_Logprobs = Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), WHOLE_NUMBER]

# Unimplemented OpenAI fields and the values that ask for nothing (None is always accepted).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "best_of": (1,),
}


class StreamOptions(RequestBody):
    include_usage: StrictBool = False


class _GenerationRequest(VllmFields):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, and vLLM's
    extensions (graphguard/server/vllm_fields.py)."""

    model_config = ConfigDict(
        extra="ignore",
        allow_inf_nan=False,
        json_schema_extra=STREAM_OPTIONS_NEED_A_STREAM,
    )

    model: str
    # 0 only with completions' echo
    max_tokens: Annotated[StrictInt, Field(ge=0), WHOLE_NUMBER] | None = None
    # The newer name of max_tokens; both may be sent, but only with the same value.
    max_completion_tokens: Annotated[StrictInt, Field(ge=0), WHOLE_NUMBER] | None = None
    # Below the engine's GREEDY_BELOW_TEMPERATURE a temperature is greedy, so every one is usable.
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    # NOTE: the schema states the bound that _top_p_keeps_a_token checks (with its reason).
    top_p: (
        Annotated[
            StrictFloat,
            Field(gt=0.0, le=1.0, json_schema_extra={"exclusiveMinimum": MIN_TOP_P_EXCLUSIVE}),
        ]
        | None
    ) = None
    # Extension (as in vLLM): keep the k likeliest tokens; 0 and -1 keep all.
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K), WHOLE_NUMBER] | None = None
    seed: (
        Annotated[
            StrictInt, Field(ge=MIN_SEED, le=MAX_SEED, json_schema_extra=INT64_BOUND), WHOLE_NUMBER
        ]
        | None
    ) = None
    n: Annotated[
        StrictInt,
        Field(ge=1, le=MAX_CHOICES_PER_REQUEST, json_schema_extra=CHOICES_BOUND),
        WHOLE_NUMBER,
    ] = 1
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = None
    # Extension (as in vLLM): end the answer when it generates one of these tokens.
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Extension (as in vLLM): keep generating past end-of-sequence, for fixed-length benchmarks.
    ignore_eos: StrictBool = False
    logit_bias: Annotated[
        dict[str, StrictFloat] | None,
        AfterValidator(checked_logit_bias),
        Field(json_schema_extra=LOGIT_BIAS_SCHEMA),
    ] = None
    response_format: ResponseFormatBody | None = None
    user: str | None = None  # OpenAI's end-user id: taken, as vLLM takes it, and not used

    _refuse_unsupported = refuse_unless_off(UNSUPPORTED_FIELDS)

    @field_validator("model", "stop")
    @classmethod
    def _valid_unicode(cls, value: str | list[str] | None) -> str | list[str] | None:
        valid_texts(value)
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees_with_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        # NOTE: vLLM lets max_completion_tokens win; a client that sends two different
        # limits has a bug it should hear about.
        max_tokens = info.data.get("max_tokens")
        if None not in (value, max_tokens) and value != max_tokens:
            raise ValueError(
                f"max_completion_tokens ({value}) and max_tokens ({max_tokens}) disagree; "
                "send one of them, or both with the same value"
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_keeps_a_token(cls, top_p: float | None) -> float | None:
        if top_p is not None and top_p <= MIN_TOP_P_EXCLUSIVE:
            raise ValueError(
                f"top_p {top_p!r} is 0 in float32, where the sampler compares it, "
                "and would keep no token"
            )
        return top_p

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set with stream: true")
        return value

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

    @model_validator(mode="after")
    def _one_output_constraint(self) -> Self:
        guided = self.guided_format()  # ValueError where several guided fields are given
        if guided is not None and engine_response_format(self.response_format) is not None:
            raise ValueError(f"give response_format or {guided.param}, not both")
        return self

    @property
    def engine_response_format(self) -> ResponseFormat | None:
        """The output constraint of `response_format`, `structured_outputs` or a `guided_*`
        field (one of them at most, checked when the body was read)."""
        return self.guided_format() or engine_response_format(self.response_format)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        """The completion-token limit asked for, under either name."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is what OpenAI accepts: text, token ids, or a list of
    either (one choice each); validated, it is always the list of prompts."""

    prompt: Annotated[
        list[Prompt], BeforeValidator(completion_prompts, json_schema_input_type=PromptInput)
    ]
    # The chosen token's log probability and this many alternatives per generated token.
    logprobs: _Logprobs | None = None
    # The prompt comes back before the completion (with its tokens' logprobs, if asked for).
    echo: StrictBool | None = None
    suffix: Annotated[Any, off_value_schema(UNSUPPORTED_FIELDS["suffix"])] = None
    best_of: Annotated[Any, off_value_schema(UNSUPPORTED_FIELDS["best_of"])] = None


class TextPart(RequestBody):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _valid_unicode(cls, text: str) -> str:
        return valid_unicode(text)


class ImageURL(RequestBody):
    url: str  # only base64 data URLs are accepted (graphguard.engine.models.images)
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("url")
    @classmethod
    def _valid_unicode(cls, url: str) -> str:
        return valid_unicode(url)


class ImagePart(RequestBody):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ToolCallFunction(RequestBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(RequestBody):
    """An assistant message's call of a tool, as the history carries it back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def as_template_dict(self) -> dict[str, Any]:
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments  # the template gets the text as it came
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": self.type, "function": function}


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # the participant's name (OpenAI's)
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _valid_unicode(cls, content: str | list[Any] | None) -> str | list[Any] | None:
        valid_texts(content)  # the parts' texts are checked by TextPart
        return content

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def as_template_dict(self, image_text: str = "") -> dict[str, Any]:
        """The message as the chat template expects it: plain-text content, each image part
        written as `image_text` (the image placeholder token); a name, tool calls (their
        arguments parsed, as transformers' templates read them) and a tool call id where it
        has them."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(
                part.text if isinstance(part, TextPart) else image_text for part in content
            )
        # Chat templates of this model family know "system", not the newer "developer".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        return message


def check_continuation(messages: list[ChatMessage], add_generation_prompt: bool) -> None:
    """ValueError unless `continue_final_message` can continue these messages."""
    if add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt exclude each other: set "
            "add_generation_prompt to false to continue the last message"
        )
    if messages[-1].role != "assistant":
        raise ValueError("continue_final_message continues an assistant message, the last")


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(
        extra="ignore",
        allow_inf_nan=False,
        json_schema_extra={
            "allOf": [
                STREAM_OPTIONS_NEED_A_STREAM,
                TOP_LOGPROBS_NEED_LOGPROBS,
                CONTINUING_OPENS_NO_TURN,
                CONSTRAINED_TOOLS,
            ]
        },  # fmt: skip
    )

    messages: list[ChatMessage] = Field(min_length=1)
    # The chat template's controls (vLLM's): the assistant's turn opened, or the last message
    # left open to continue it; another template; the template's own variables.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the answer begins with the last message's text where that is the assistant's
    echo: StrictBool = False
    # No echo of the prompt's tokens: 0 asks for nothing.
    max_tokens: Annotated[StrictInt, Field(ge=1), WHOLE_NUMBER] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1), WHOLE_NUMBER] | None = None
    tools: Tools | None = None
    # OpenAI's default: "auto" where tools are given (graphguard/server/tool_calls.py)
    tool_choice: ToolChoice | None = None
    functions: Annotated[Any, off_value_schema(UNSUPPORTED_FIELDS["functions"])] = None
    function_call: Annotated[Any, off_value_schema(UNSUPPORTED_FIELDS["function_call"])] = None

    logprobs: StrictBool | None = None
    top_logprobs: (
        Annotated[StrictInt, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS), WHOLE_NUMBER] | None
    ) = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_fits_the_tools(
        cls, choice: ToolChoice | None, info: ValidationInfo
    ) -> ToolChoice | None:
        if "tools" in info.data:  # NOTE: else the tools were refused, and that is the error
            check_tools(info.data["tools"], choice)
        return choice

    @model_validator(mode="after")
    def _tool_calls_alone(self) -> Self:
        constrained = self.tool_choice not in (None, "auto", "none") and self.tools
        if constrained and self.engine_response_format is not None:
            raise ValueError(
                "tool_choice required or a named function constrains the answer to tool calls; "
                "it takes no response_format or structured output besides"
            )
        return self

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> Self:
        if self.continue_final_message:
            check_continuation(self.messages, self.add_generation_prompt)
        return self

    @property
    def echo_text(self) -> str:
        """What the answer begins with under `echo`: the last message's text, where it is the
        assistant's (the role the answer has)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or not isinstance(last.content, str):
            return ""
        return last.content

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
