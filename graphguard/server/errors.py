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

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
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
    """The first problem pydantic found, with the offending field as `param`."""
    first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        detail = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return APIError(400, f"Malformed JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    where = f"'{param}': " if param else ""
    return APIError(400, f"{where}{message}", param=param, code="invalid_value")


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc))


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail)))


async def _on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request", exc_info=exc)
    return error_response(APIError(500, "internal server error", error_type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to an OpenAI-style error body."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
