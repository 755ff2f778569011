"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server answers, from malformed JSON to an engine exception, goes through
`error_response`, so clients see one shape whatever went wrong.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("graphguard.server")
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool"})

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # as OpenAI answers a wrong key (code "invalid_api_key")
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",  # the client did not send its request in time
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the client caused or should know about; rendered as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        # NOTE: a message may quote the request (a model name), and a lone surrogate there
        # would make the response itself fail to encode; spell such characters out.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "api_error")


def error_body(error: APIError) -> dict[str, Any]:
    """The JSON body for `error`; also sent as the last event of a stream that fails."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status_code)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, with the offending field as `param`: one of our own
    checks (a value error) before a type mismatch, which in a union every other branch of the
    field also reports."""
    errors = exc.errors() or [{"msg": "invalid request", "loc": ()}]
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        detail = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return APIError(400, f"Malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if _is_field(part)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    where = f"'{param}': " if param else ""
    return APIError(400, f"{where}{message}", param=param, code="invalid_value")


def _is_field(part: int | str) -> bool:
    """Whether a part of a pydantic error location names a field or an index, rather than the
    body or a branch of a union (`str`, `list[int]`, `tagged-union[...]`)."""
    return part != "body" and part not in _UNION_BRANCHES and "[" not in str(part)


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc))


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    response = error_response(APIError(exc.status_code, str(exc.detail)))
    # NOTE: the router's headers belong to the answer: a 405 names the allowed methods (Allow)
    response.headers.update(exc.headers or {})
    return response


class EngineClosedError(RuntimeError):
    """The server is shutting down, or its engine is gone: it takes no new requests (503)."""


async def _on_engine_closed(_: Request, exc: Exception) -> JSONResponse:
    # the engine is shutting down or gone: a 503 that says which, never a 500
    return error_response(APIError(503, str(exc), error_type="server_error"))


async def _on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request", exc_info=exc)
    return error_response(APIError(500, "internal server error", error_type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to an OpenAI-style error body."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(EngineClosedError, _on_engine_closed)
    app.add_exception_handler(Exception, _on_unexpected_error)
