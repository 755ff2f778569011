"""What every request body shares: the base model (unknown fields noted, no NaN
or infinities), integer fields that take `2.0` as 2, and the text and "off value" checks."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ModelWrapValidatorHandler,
    PrivateAttr,
    StrictInt,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

logger = logging.getLogger("graphguard.server")
MAX_UNKNOWN_FIELDS_LOGGED = 8  # names per log line; the rest are counted


def whole_number(value: Any) -> Any:
    """A float with no fraction (`2.0`, as JavaScript clients write integers) as the int it is;
    any other float is refused; everything else passes unchanged to the strict int check."""
    if type(value) is float:
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return value


# What makes an integer field take a JSON integer or a number with no fraction (what JSON
# Schema's "integer" admits, so the OpenAPI document stays true), never a boolean. It goes last
# in `Annotated[StrictInt, Field(<bounds>), WHOLE_NUMBER]`: bounds given outside it would not
# reach the schema as minimum / maximum.
WHOLE_NUMBER = BeforeValidator(whole_number)

# A schema keyword naming bounds the OpenAPI document (graphguard.server.openapi) fills in:
# those that depend on the server (its vocabulary, its engine), and the signed 64-bit limits,
# which FastAPI would write as floats (2**63 - 1 becomes 2**63, a value validation refuses).
SERVER_BOUND = "x-server-bound"
TOKEN_ID_BOUND: dict[str, Any] = {SERVER_BOUND: "token_id"}  # at most the vocabulary size - 1
CHOICES_BOUND: dict[str, Any] = {SERVER_BOUND: "choices"}  # n: at most --max-num-seqs too
INT64_BOUND: dict[str, Any] = {SERVER_BOUND: "int64"}

TokenId = Annotated[StrictInt, Field(ge=0, json_schema_extra=TOKEN_ID_BOUND), WHOLE_NUMBER]


def asks_for_nothing(value: Any, off_values: tuple[Any, ...]) -> bool:
    """Whether `value` is None or one of `off_values` (an integer one also as 1.0)."""
    if type(value) is float and value.is_integer():
        value = int(value)
    # NOTE: compare types too: in Python 0 == False and 1 == True (best_of=True is not 1).
    return value is None or any(type(value) is type(off) and value == off for off in off_values)


def off_value_schema(off_values: tuple[Any, ...]) -> WithJsonSchema:
    """The document's schema of a field taken only at `off_values` or null (see
    refuse_unless_off)."""
    options: list[dict[str, Any]] = [
        {"type": "array", "maxItems": 0} if value == [] else {"const": value}
        for value in off_values
    ]
    return WithJsonSchema({"anyOf": [*options, {"type": "null"}]})


def refuse_unless_off(off_values: Mapping[str, tuple[Any, ...]]) -> Any:
    """A field validator for a request model's class body over the fields of `off_values`:
    each is accepted unset or at one of its off values (which clients often send) and refused
    otherwise, naming the field."""

    def refuse(cls: type, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        if not asks_for_nothing(value, off_values[name]):
            raise ValueError(f"{name} is not supported by this server")
        return value

    return field_validator(*off_values, check_fields=False)(classmethod(refuse))


def valid_unicode(text: str) -> str:
    """`text`, if it encodes as UTF-8: a lone surrogate (JSON `"\\ud800"`) does not, and would
    fail later in the tokenizer or while writing a response."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text holds a lone UTF-16 surrogate at index {exc.start}") from None
    return text


def valid_texts(value: str | list[Any] | None) -> None:
    """Check the strings of `value` (one, or those of a list) with valid_unicode."""
    for text in [value] if isinstance(value, str) else value or []:
        if isinstance(text, str):
            valid_unicode(text)


class RequestBody(BaseModel):
    """A request body or a part of one. Fields it does not declare are noted
    (`unknown_fields`): the server refuses a request that has any, naming them, unless it is
    permissive, when they are ignored with a warning in its log, as vLLM does."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _unknown: list[str] = PrivateAttr(default_factory=list)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # the document states what a request may hold: a field it does not declare is a 400
        # (a permissive server takes more than it states, which a client may not rely on)
        schema = handler.resolve_ref_schema(handler(core_schema))
        schema["additionalProperties"] = False
        return schema

    @model_validator(mode="wrap")
    @classmethod
    def _note_unknown_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        body = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            # NOTE: names are the client's: cut to size where they are shown
            body._unknown = sorted(str(name)[:64] for name in set(data) - known)
        return body


def unknown_fields(body: BaseModel, path: str = "") -> list[str]:
    """The fields of `body` and of the bodies in it that they do not declare, by their path
    (`messages[0].names`)."""
    found = [path + name for name in getattr(body, "_unknown", [])]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{path}{name}[{index}]." if isinstance(value, list) else f"{path}{name}."
                found += unknown_fields(item, where)
    return found


def log_unknown_fields(names: list[str], kind: str) -> None:
    """The warning a permissive server writes for the fields it ignored."""
    shown = names[:MAX_UNKNOWN_FIELDS_LOGGED]
    more = len(names) - len(shown)
    logger.warning(
        "%s: ignored fields this server does not know: %r%s",
        kind, shown, f" and {more} more" if more else "",
    )  # fmt: skip
