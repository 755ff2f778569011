"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Evaluation harnesses use them to tokenize with the server's own tokenizer (lm-evaluation-
harness's `local-completions` does by default: its remote tokenizer reads /tokenizer_info and
sends `{"prompt": text, "add_special_tokens": false}` to /tokenize and `{"tokens": [...]}` to
/detokenize). Requests and answers have vLLM's shapes; `model`, when sent, must name the
served model.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic.json_schema import JsonDict

from graphguard.engine.tokens.tokenizer import Tokenizer
from graphguard.server import responses as r
from graphguard.server.context import ServingContext, text_work
from graphguard.server.errors import APIError
from graphguard.server.fields import RequestBody, TokenId, valid_unicode
from graphguard.server.formatting import token_name
from graphguard.server.images import ChatRendering, chat_prompt
from graphguard.server.protocol import ChatMessage, check_continuation, continuing_opens_no_turn
from graphguard.server.tool_calls import Tools, ToolUse

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# chat's rule, for the messages form only: a prompt has no turns, so its flags are unread
_CONTINUING_A_CONVERSATION = continuing_opens_no_turn("messages")
# Exactly one of `prompt` and `messages`, as the document states it.
_ONE_INPUT: JsonDict = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


class TokenizeRequest(RequestBody):
    """POST /tokenize: text (`prompt`) or a conversation (`messages`, rendered by the chat
    template as /v1/chat/completions renders it, with the same controls and tools).
    `add_special_tokens` defaults to true for text (a start token, if the tokenizer adds one)
    and false for a conversation (its template places them), as in vLLM."""

    model_config = ConfigDict(
        extra="ignore",
        allow_inf_nan=False,
        json_schema_extra={"allOf": [_ONE_INPUT, _CONTINUING_A_CONVERSATION]},
    )

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool | None = False
    continue_final_message: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None

    @field_validator("model", "prompt")
    @classmethod
    def _valid_unicode(cls, text: str | None) -> str | None:
        return text if text is None else valid_unicode(text)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt (text) or messages (a conversation)")
        if self.continue_final_message and self.messages is not None:
            check_continuation(self.messages, self.add_generation_prompt)
        return self


class DetokenizeRequest(RequestBody):
    """POST /detokenize: token ids back to text, control tokens spelled out."""

    model: str | None = None
    tokens: list[TokenId]

    @field_validator("model")
    @classmethod
    def _valid_unicode(cls, text: str | None) -> str | None:
        return text if text is None else valid_unicode(text)


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> r.TokenizeResponse:
    """The token ids of `prompt`, or of `messages` as the chat template renders them (image
    parts as the vision encoder's placeholder tokens). Text of any length is tokenized: an
    evaluation harness counts whole documents longer than the context."""
    _check_model(ctx, body.model)
    if body.messages is not None:
        add_special = bool(body.add_special_tokens)
        rendering = ChatRendering(
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=add_special,
            continue_final_message=body.continue_final_message,
            chat_template=body.chat_template or ctx.chat_template,
            template_kwargs=body.chat_template_kwargs,
            tool_use=ToolUse.of(body.tools, "auto", ctx.tool_format),
            tool_format=ctx.tool_format,
        )
        ids, _ = await chat_prompt(ctx, body.messages, rendering)
    else:
        text, add_special = body.prompt or "", body.add_special_tokens is not False
        ids = await text_work(len(text), ctx.tokenizer.encode, text, add_special)
    names = [token_name(ctx.tokenizer.token_bytes(t)) for t in ids]
    return r.TokenizeResponse(
        count=len(ids),
        max_model_len=ctx.max_model_len,
        tokens=ids,
        token_strs=names if body.return_token_strs else None,
    )


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> r.DetokenizeResponse:
    """The text of `tokens`, control tokens included (as vLLM decodes); a 400 naming
    `tokens` for an id outside the vocabulary."""
    _check_model(ctx, body.model)
    if any(token_id >= ctx.vocab_size for token_id in body.tokens):
        message = f"Token ids must be in [0, {ctx.vocab_size})."
        raise APIError(400, message, param="tokens", code="invalid_value")
    text = await text_work(len(body.tokens), _decode, ctx.tokenizer, body.tokens)
    return r.DetokenizeResponse(prompt=text)


def tokenizer_info(ctx: ServingContext) -> r.TokenizerInfo:
    """The tokenizer's special tokens (text and id; null where it has none), its chat template
    and class, and the longest context this server takes as `model_max_length`."""
    tokenizer = ctx.tokenizer
    tokens = {name: _special_token(tokenizer, name) for name in SPECIAL_TOKENS}
    ids = {f"{name}_id": _token_id(tokenizer, text) for name, text in tokens.items()}
    info = {
        "tokenizer_class": type(tokenizer).__name__,
        "name_or_path": ctx.model_name,
        "model_max_length": ctx.max_model_len,
        "chat_template": tokenizer.chat_template,
    }
    return r.TokenizerInfo.model_validate(info | tokens | ids)


def _special_token(tokenizer: Tokenizer, name: str) -> str | None:
    """The text of special token `name`; for the end of sequence, the model's first one when
    the tokenizer's configuration names none."""
    text = tokenizer.special_tokens.get(name)
    if text is None and name == "eos_token" and tokenizer.eos_token_ids:
        text = tokenizer.token_bytes(tokenizer.eos_token_ids[0]).decode("utf-8", "replace")
    return text


def _token_id(tokenizer: Tokenizer, text: str | None) -> int | None:
    return None if text is None else tokenizer.token_to_id(text)


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def _check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None:
        ctx.check_model(model)
