"""vLLM's extensions of the OpenAI request bodies, shared by completions and chat: its sampling
fields, its structured-output fields (`structured_outputs` and the older `guided_*`), and
`cache_salt`. Each is honoured (graphguard/engine/tokens/sampling.py SamplingParams), or refused
with a 400 that names it."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator

from graphguard.engine.tokens.limits import (
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)
from graphguard.engine.tokens.structured import ResponseFormat, ResponseFormatKind
from graphguard.server.fields import WHOLE_NUMBER, RequestBody, TokenId, valid_texts

MAX_CACHE_SALT_CHARS = 1024
# the structured-output backends vLLM names; graphguard's is llguidance whichever is named
GuidedBackend = Literal[
    "auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer"
]
# the fields that constrain the output: one at most (a 400 names them otherwise; the document
# does not state it: its generators cannot expand the rule)
OUTPUT_CONSTRAINTS = (
    "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None

    model_config = {**RequestBody.model_config, "populate_by_name": True}

    def response_format(self) -> ResponseFormat | None:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name)]
        if self.json_object:
            given.append("json_object")
        if len(given) > 1:
            raise ValueError(f"structured_outputs takes one constraint, got {given}")
        return _format(given[0] if given else None, self, "structured_outputs")


def _format(name: str | None, source: Any, param: str) -> ResponseFormat | None:
    if name is None:
        return None
    if name == "json_object":
        return ResponseFormat(ResponseFormatKind.JSON_OBJECT, param=param)
    value = getattr(source, name)
    if name.endswith("json") or name == "json_":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as exc:
            raise ValueError(f"{param}: not the JSON text of a schema ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{param}: a JSON schema must be an object")
        return ResponseFormat.json_schema(schema, param)
    if name.endswith("choice"):
        return ResponseFormat.choice(value, param)
    kind = ResponseFormatKind.REGEX if name.endswith("regex") else ResponseFormatKind.GRAMMAR
    return ResponseFormat(kind, value, param)


class VllmFields(RequestBody):
    """vLLM's fields beyond OpenAI's (see module docstring)."""

    min_tokens: Annotated[StrictInt, Field(ge=0), WHOLE_NUMBER] | None = None
    repetition_penalty: StrictFloat | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS), WHOLE_NUMBER] | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=1), WHOLE_NUMBER] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    # vLLM's: a request's cached prefixes are shared only with requests of the same salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: GuidedBackend | None = None

    @field_validator("bad_words", "guided_regex", "guided_grammar", "cache_salt")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        valid_texts(value)
        if isinstance(value, list) and any(not word for word in value):
            raise ValueError("bad words must be non-empty strings")
        return value

    def guided_format(self) -> ResponseFormat | None:
        """The output constraint of `structured_outputs` or a `guided_*` field (one of them
        at most); ValueError naming them where several are given."""
        guided = [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, n) is not None]  # fmt: skip
        if self.structured_outputs is not None:
            guided.append("structured_outputs")
        if len(guided) > 1:
            raise ValueError(f"give one output constraint at most, got {guided}")
        if guided == ["structured_outputs"]:
            assert self.structured_outputs is not None
            return self.structured_outputs.response_format()
        return _format(guided[0] if guided else None, self, guided[0] if guided else "")

    def sampling_fields(self) -> dict[str, Any]:
        """These fields as SamplingParams keywords (unset ones left to the defaults;
        repetition_penalty and min_p are the handler's, which fills them from the generation
        config where unset)."""
        fields: dict[str, Any] = dict(
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            bad_words=tuple(self.bad_words or ()),
        )
        for name in ("min_tokens", "prompt_logprobs", "truncate_prompt_tokens", "cache_salt"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.allowed_token_ids is not None:
            fields["allowed_token_ids"] = tuple(self.allowed_token_ids)
        return fields
