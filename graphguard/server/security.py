"""Who may talk to the server: the Host header check (against DNS rebinding) and the API key.

Both are ASGI middleware around the app, so they answer before any route runs, for every path
(unknown ones too), with an OpenAI-shaped error body.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from graphguard.server.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key (probes, scrapes)
KEY_ID = "graphguard_api_key_id"  # the scope state's entry naming an authorized request's key


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
    """Answers 401 to a request without `Authorization: Bearer <key>` for one of `api_keys`,
    but on OPEN_PATHS. An authorized request carries its key's id (`key_id`) in its ASGI
    scope's state, for the prefix cache to keep keys apart.

    Keys are compared as SHA-256 digests with `hmac.compare_digest`: in constant time, and
    without the time depending on the length of the key sent (every key is compared).
    """

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key_id = self._key_id(scope)
        if key_id is not None:
            scope.setdefault("state", {})[KEY_ID] = key_id
            await self.app(scope, receive, send)
            return
        message = "Missing or incorrect API key: send it as 'Authorization: Bearer <key>'."
        response = error_response(APIError(401, message, code="invalid_api_key"))
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _key_id(self, scope: Scope) -> str | None:
        """The id of the key the request sends (a digest's prefix, never the key), or None."""
        scheme, _, key = (header(scope, b"authorization") or b"").partition(b" ")
        digest = hashlib.sha256(key.strip()).digest()
        found = None
        for known in self._digests:  # all of them: the time names no key
            if hmac.compare_digest(digest, known):
                found = known
        if found is None or scheme.lower() != b"bearer":
            return None
        return found[:8].hex()


def key_id(state: Mapping[str, object]) -> str | None:
    """The API key id an authorized request's state carries (None without API keys)."""
    value = state.get(KEY_ID)
    return value if isinstance(value, str) else None
