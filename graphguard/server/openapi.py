"""The OpenAPI document (/openapi.json) tells what the server answers, so a client generator
or a fuzzer that trusts it is not misled.

Routes declare their own error statuses (`error_responses`) and their stream (`streamed`);
`ServerAPI` adds what the ASGI middleware answers before any route runs, which depends on the
server's configuration (the Host check, the API key, the body limit and deadline), and drops
FastAPI's 422 (validation errors are 400s here, errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from graphguard.server import responses as r
from graphguard.server.config import ServerConfig
from graphguard.server.fields import SERVER_BOUND
from graphguard.server.protocol import MAX_CHOICES_PER_REQUEST, MAX_SEED, MIN_SEED
from graphguard.server.security import OPEN_PATHS

ERROR_SCHEMA_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range, or a prompt that "
    "does not fit the context; `param` names the field.",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`).",
    403: "The Host header names none of the names this server answers to.",
    404: "Unknown model id (`code: model_not_found`).",
    408: "The request body did not arrive within the body timeout.",
    413: "The request body is larger than --max-request-bytes.",
    503: "The server is shutting down.",
}
MEDIA_TYPE_SSE = "text/event-stream"


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` entries of a route for `statuses`, each an OpenAI error body."""
    return {status: _error_response(status) for status in statuses}


def _error_response(status: int) -> dict[str, Any]:
    return {"model": r.ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}


def streamed(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The 200 entry of a route that streams `chunk`s as server-sent events with `stream: true`
    (and answers JSON otherwise): one `data:` event per chunk, an error body if the stream
    fails, then `data: [DONE]`."""
    chunk_ref = {"$ref": f"#/components/schemas/{chunk.__name__}"}
    as_json = {
        "type": "string",
        "description": f"a {chunk.__name__}, or an ErrorResponse if the stream fails",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [chunk_ref, ERROR_SCHEMA_REF]},
    }
    data = {"anyOf": [as_json, {"const": "[DONE]", "description": "the end of the stream"}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    # NOTE: before OpenAPI 3.2, the `schema` of an event stream describes one event.
    content = {MEDIA_TYPE_SSE: {"schema": event}}
    return {
        200: {"description": "The answer, or its chunks with `stream: true`", "content": content}
    }


class ServerAPI(FastAPI):
    """A FastAPI app whose OpenAPI document also tells what the middleware answers under
    `config`, and declares the chunk models of its streams."""

    def __init__(self, config: ServerConfig, chunks: tuple[type[BaseModel], ...], **kwargs: Any):
        super().__init__(**kwargs)
        self._config = config
        self._chunks = chunks

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()  # cached by FastAPI; the changes below are idempotent
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                self._document_operation(path, operation)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        _drop_validation_schemas(schemas)
        _fill_server_bounds(schemas, self._server_bounds())
        models: tuple[type[BaseModel], ...] = (r.ErrorResponse, *self._chunks)
        for model in models:
            _add_component(schemas, model)
        if self._config.api_key is not None:
            bearer = {"type": "http", "scheme": "bearer"}
            components.setdefault("securitySchemes", {})["bearer"] = bearer
        return schema

    def _document_operation(self, path: str, operation: dict[str, Any]) -> None:
        responses = operation["responses"]
        responses.pop("422", None)  # never sent: errors.py answers validation errors with 400
        for status in self._middleware_statuses(path):
            entry = {"description": ERROR_DESCRIPTIONS[status], "content": _error_content()}
            responses.setdefault(str(status), entry)
        operation["responses"] = dict(sorted(responses.items()))
        if self._config.api_key is not None and path not in OPEN_PATHS:
            operation["security"] = [{"bearer": []}]

    def _server_bounds(self) -> dict[str, dict[str, int]]:
        """The bounds of each SERVER_BOUND kind on this server."""
        vocab_size: int = self.state.serving.vocab_size  # set by build_app
        max_choices = min(MAX_CHOICES_PER_REQUEST, self._config.engine.max_num_seqs)
        return {
            "token_id": {"minimum": 0, "maximum": vocab_size - 1},
            "choices": {"minimum": 1, "maximum": max_choices},
            "int64": {"minimum": MIN_SEED, "maximum": MAX_SEED},
        }

    def _middleware_statuses(self, path: str) -> list[int]:
        """What the middleware may answer on `path` before its route runs (app.py)."""
        statuses = [408, 413]  # body_limit.py, on every request
        if self._config.allowed_host_names is not None:
            statuses.append(403)
        if self._config.api_key is not None and path not in OPEN_PATHS:
            statuses.append(401)
        return statuses


def _error_content() -> dict[str, Any]:
    return {"application/json": {"schema": ERROR_SCHEMA_REF}}


def _add_component(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    """`model` and the models it nests as components (those FastAPI wrote stay as they are)."""
    schema = model.model_json_schema(
        ref_template="#/components/schemas/{model}", mode="serialization"
    )
    for name, nested in schema.pop("$defs", {}).items():
        schemas.setdefault(name, nested)
    schemas.setdefault(model.__name__, schema)


def _fill_server_bounds(node: Any, bounds: dict[str, dict[str, int]]) -> None:
    """Replace each SERVER_BOUND keyword under `node` by the bounds it names, so the document
    admits what validation admits."""
    if isinstance(node, list):
        for item in node:
            _fill_server_bounds(item, bounds)
    if not isinstance(node, dict):
        return
    kind = node.pop(SERVER_BOUND, None)
    if kind is not None:
        node.update(bounds[kind])
    for value in node.values():
        _fill_server_bounds(value, bounds)


def _drop_validation_schemas(schemas: dict[str, Any]) -> None:
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
