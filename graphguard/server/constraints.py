"""Request fields that constrain what the model may write: `response_format` (OpenAI's
shapes, turned into the engine's ResponseFormat) and `logit_bias` (checked here; the handler
checks its token ids against the vocabulary)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool

from graphguard.engine.tokens.limits import MAX_LOGIT_BIAS
from graphguard.engine.tokens.structured import ResponseFormat, ResponseFormatKind
from graphguard.server.fields import RequestBody

# A logit_bias key: a token id in decimal, without leading zeros (so distinct keys are
# distinct ids, as the document can state).
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")
# What checked_logit_bias takes, as the OpenAPI document states it.
LOGIT_BIAS_SCHEMA: dict[str, Any] = {
    "propertyNames": {"pattern": f"^({TOKEN_ID_KEY.pattern})$"},
    "additionalProperties": {
        "type": "number",
        "minimum": -MAX_LOGIT_BIAS,
        "maximum": MAX_LOGIT_BIAS,
    },
}


class Body(RequestBody):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class JsonSchemaFormat(Body):
    """`response_format.json_schema`: the schema the output must validate against."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # NOTE: "schema" is a name BaseModel uses itself, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextResponseFormat(Body):
    type: Literal["text"]


class JsonObjectResponseFormat(Body):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormatBody = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
    Field(discriminator="type"),
]


def engine_response_format(body: ResponseFormatBody | None) -> ResponseFormat | None:
    """The engine's ResponseFormat of a request's `response_format` (None: plain text). A
    json_schema without a schema asks for any JSON object."""
    if isinstance(body, JsonObjectResponseFormat):
        return ResponseFormat(ResponseFormatKind.JSON_OBJECT)
    if isinstance(body, JsonSchemaResponseFormat):
        schema = body.json_schema.schema_
        if schema is None:
            return ResponseFormat(ResponseFormatKind.JSON_OBJECT)
        return ResponseFormat.json_schema(schema)
    return None


def checked_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's logit_bias: token ids (decimal strings) to biases in [-100, 100]."""
    seen: set[int] = set()
    for key, bias in (value or {}).items():
        if not TOKEN_ID_KEY.fullmatch(key) or int(key) in seen:
            raise ValueError(f"logit_bias keys must be distinct token ids, got {key!r}")
        seen.add(int(key))
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {bias!r} for token {key}"
            )
    return value
