"""Who may talk to the server: the Host header check (against DNS rebinding) and the API key.

Both are ASGI middleware around the app, so they answer before any route runs, for every path
(unknown ones too), with an OpenAI-shaped error body.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from graphguard.server.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key (probes, scrapes)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of the request header `name` (lowercase), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def host_name(host_header: str) -> str:
    """The name in a Host header: `Example.com:8000` -> `example.com`, `[::1]:8000` -> `::1`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:  # more than one colon is a bare IPv6 address
        host = host.partition(":")[0]
    return host.rstrip(".")


class HostCheckMiddleware:
    """Refuses (403) a request whose Host header names none of `allowed`.

    A browser page whose domain was re-pointed at 127.0.0.1 sends its own domain as Host, so
    this keeps a loopback server out of reach of web pages. A request without a Host header
    (HTTP/1.0) passes: browsers always send one.
    """

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = header(scope, b"host") if scope["type"] == "http" else None
        if host is None or host_name(host.decode("latin-1")) in self.allowed:
            await self.app(scope, receive, send)
            return
        message = (
            f"Host {host.decode('latin-1')!r} is not one this server answers to; "
            "start it with --allowed-hosts to add a name."
        )
        error = APIError(403, message, code="host_not_allowed")
        await error_response(error)(scope, receive, send)


class APIKeyMiddleware:
    """Answers 401 to a request without `Authorization: Bearer <api_key>`, but on OPEN_PATHS.

    Keys are compared as SHA-256 digests with `hmac.compare_digest`: in constant time, and
    without the time depending on the length of the key sent.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key_digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._is_authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "Missing or incorrect API key: send it as 'Authorization: Bearer <key>'."
        response = error_response(APIError(401, message, code="invalid_api_key"))
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _is_authorized(self, scope: Scope) -> bool:
        scheme, _, key = (header(scope, b"authorization") or b"").partition(b" ")
        digest = hashlib.sha256(key.strip()).digest()
        return hmac.compare_digest(digest, self._key_digest) and scheme.lower() == b"bearer"
