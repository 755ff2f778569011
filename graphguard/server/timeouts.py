"""How long a client may take to send a request: its headers (`HeaderTimeoutProtocol`, here)
and its body (`BodyLimitMiddleware`, graphguard/server/body_limit.py). The same protocol
answers a request head that cannot be parsed with an OpenAI error body.

uvicorn bounds only the idle time between requests on a kept-alive connection
(`timeout_keep_alive`) and the size of a request head (h11's 16 KiB); a client that connects
and sends nothing, or dribbles its head a byte at a time, holds its connection for ever
(slowloris). The head is read before any ASGI app is called, so its deadline lives in the
HTTP protocol: a subclass of uvicorn's h11 protocol, handed to uvicorn through its `http`
setting.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from graphguard.server.errors import APIError, error_body


def timeout_response(message: str) -> bytes:
    """A whole HTTP/1.1 408 response with an OpenAI error body, that closes the connection."""
    body = json.dumps(error_body(APIError(408, message, code="request_timeout"))).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head: `header_timeout_s` from
    the connection's start, or from the first byte of a later request on it. A client that
    sent part of a head by then gets a 408 and the connection closes; one that sent nothing
    is closed. Build it with `functools.partial(HeaderTimeoutProtocol, header_timeout_s=...)`;
    `on_timeout`, if given, is told of each (the server counts them in /metrics).
    """

    def __init__(
        self,
        *args: Any,
        header_timeout_s: float,
        on_timeout: Callable[[bool], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.on_timeout = on_timeout  # told of each deadline met: whether a 408 was sent
        self._header_deadline: asyncio.TimerHandle | None = None
        self._num_head_bytes = 0  # bytes received towards the head being awaited

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._is_awaiting_head():
            if self._header_deadline is None:  # the first byte of a later request
                self._arm()
            self._num_head_bytes += len(data)
        super().data_received(data)
        if not self._is_awaiting_head():  # the head is in: its route reads the body
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """A request head h11 cannot parse: an OpenAI error body (uvicorn's own is plain text),
        then the connection closes."""
        error = APIError(400, f"Malformed HTTP request: {msg}", code="malformed_request")
        body = json.dumps(error_body(error)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _is_awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        self._num_head_bytes = 0

    def _on_deadline(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or not self._is_awaiting_head():
            return
        answered = self._num_head_bytes > 0
        if answered:
            message = f"The request headers did not arrive within {self.header_timeout_s:g} s."
            self.transport.write(timeout_response(message))
        self.transport.close()
        if self.on_timeout is not None:
            self.on_timeout(answered)
