"""`BodyLimitMiddleware`: refuse a request body over `--max-request-bytes` before it is parsed,
or one that takes longer than `--body-timeout-s` to arrive.

The declared Content-Length is checked first, so an oversized upload is refused before its
first byte is read; a chunked body is counted as it arrives and refused as soon as it passes
the limit, so at most the limit (plus the chunk that crossed it) is ever held. The deadline
covers the whole body, so a client dribbling bytes cannot hold the connection (the headers'
deadline is the HTTP protocol's: graphguard/server/timeouts.py).

Not FastAPI's own `max_body_size`: that one answers with a plain-text 413 from outside the
app's exception handlers (so neither in the OpenAI error shape nor counted by /metrics).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from graphguard.server.errors import APIError, error_response
from graphguard.server.security import header


class BodyTooLarge(Exception):
    """The request body passed the limit."""


class ClientGone(Exception):
    """The client disconnected before it had sent its body."""


async def read_body(receive: Receive, max_bytes: int) -> bytes:
    """The whole request body from `receive`; BodyTooLarge as soon as it passes `max_bytes`."""
    chunks: list[bytes] = []
    num_bytes = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def declared_length(scope: Scope) -> int | None:
    """The Content-Length header as a number, or None (chunked, or not a number)."""
    value = header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


class BodyLimitMiddleware:
    """Reads each HTTP request's body before the app does, answering 413 to one larger than
    `max_bytes` and 408 to one not in after `timeout_s`; the app then reads the body from
    memory, and later messages (a disconnect) from the client as before."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            if (declared_length(scope) or 0) > self.max_bytes:
                raise BodyTooLarge
            async with asyncio.timeout(self.timeout_s):
                body = await read_body(receive, self.max_bytes)
        except BodyTooLarge:
            message = f"The request body is larger than the limit of {self.max_bytes} bytes."
            await _refuse(APIError(413, message, code="request_too_large"), scope, receive, send)
            return
        except TimeoutError:
            message = f"The request body did not arrive within {self.timeout_s:g} s."
            await _refuse(APIError(408, message, code="request_timeout"), scope, receive, send)
            return
        except ClientGone:
            return  # nobody is left to answer
        await self.app(scope, _replay(body, receive), send)


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error_response(error)
    # The rest of the body stays unread, so the connection cannot carry another request.
    response.headers["connection"] = "close"
    await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that returns `body` as one message, then whatever `receive` returns."""
    is_replayed = False

    async def replay() -> Message:
        nonlocal is_replayed
        if is_replayed:
            return await receive()
        is_replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
