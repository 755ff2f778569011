"""A client has --header-timeout-s to send its headers and --body-timeout-s for its body: one that
dribbles bytes (slowloris) gets a 408, or is closed if it sent nothing, while the server goes
on serving everyone else; a response that takes longer than either deadline is not cut."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from graphguard.engine.engine import LLMEngine
from graphguard.server.config import ServerConfig

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import MODEL, RunningServer

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
SLACK_S = 1.5  # scheduling on a loaded 2-core machine
NUM_SLOW_CLIENTS = 16
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def strict(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(
        engine_sharing_weights(engine),
        TEST_ENGINE,
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
    )


def _connect(server: RunningServer) -> socket.socket:
    address = urlsplit(server.base_url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def _dribble(sockets: list[socket.socket], data: bytes, until_s: float) -> None:
    """Send `data` a byte at a time to each socket, a byte every 0.1 s, until `until_s`;
    none to a socket the server has answered (or closed)."""
    waiting = list(sockets)
    index = 0
    while waiting and time.monotonic() < until_s:
        answered = select.select(waiting, [], [], 0)[0]
        waiting = [sock for sock in waiting if sock not in answered]
        for sock in waiting:
            sock.send(data[index % len(data) : index % len(data) + 1])
        index += 1
        time.sleep(0.1)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _status_and_error(response: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def _complete(server: RunningServer, max_tokens: int) -> dict[str, object]:
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _get_health(sock: socket.socket) -> bytes:
    """One GET /health on `sock`, kept alive: the response's head."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    return data.partition(b"\r\n\r\n")[0]


def _header_timeouts(server: RunningServer, response: str) -> float:
    """The server's count of header timeouts with `response` ("408" or "none"), in /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    line = f'graphguard_server_header_timeouts_total{{response="{response}"}} '
    values = [float(row.removeprefix(line)) for row in text.splitlines() if row.startswith(line)]
    return values[0] if values else 0.0


def test_clients_dribbling_headers_get_a_408_while_others_are_served(
    strict: RunningServer,
) -> None:
    counted = _header_timeouts(strict, "408")
    slow = [_connect(strict) for _ in range(NUM_SLOW_CLIENTS)]
    started = time.monotonic()
    for sock in slow:
        sock.sendall(HEAD)  # a request line and headers, never the blank line that ends them
    _dribble(slow, b"X-Slow: aaaa\r\n", until_s=started + HEADER_TIMEOUT_S / 2)
    # Meanwhile the server answers everyone else.
    assert httpx.get(f"{strict.base_url}/health", timeout=5).status_code == 200
    assert _complete(strict, max_tokens=2)["choices"]
    _dribble(slow, b"X-Slow: aaaa\r\n", until_s=started + HEADER_TIMEOUT_S + SLACK_S)
    for sock in slow:
        with sock:
            status, error = _status_and_error(_read_all(sock))
            assert status == 408 and error["code"] == "request_timeout"
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 2 * SLACK_S
    assert _header_timeouts(strict, "408") == counted + NUM_SLOW_CLIENTS  # and /metrics says so


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(
    strict: RunningServer,
) -> None:
    counted = _header_timeouts(strict, "none")
    started = time.monotonic()
    with _connect(strict) as sock:
        assert _read_all(sock) == b""  # closed, without an answer to a request never made
    assert HEADER_TIMEOUT_S <= time.monotonic() - started < HEADER_TIMEOUT_S + SLACK_S
    assert _header_timeouts(strict, "none") == counted + 1


def test_a_body_sent_too_slowly_gets_a_408(strict: RunningServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    started = time.monotonic()
    with _connect(strict) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % (len(body) + 100_000))
        _dribble([sock], body, until_s=started + BODY_TIMEOUT_S + SLACK_S)
        status, error = _status_and_error(_read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"
    assert error["message"] == f"The request body did not arrive within {BODY_TIMEOUT_S:g} s."


def test_a_response_longer_than_the_deadlines_is_not_cut(strict: RunningServer) -> None:
    # The deadlines bound what the client sends, never how long the answer takes.
    started = time.monotonic()
    output = _complete(strict, max_tokens=64)
    # Both deadlines start about when the request does (64 tokens take 2.7 s or more here).
    assert time.monotonic() - started > max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + 0.5, "too fast"
    assert output["usage"]["completion_tokens"] == 64  # type: ignore[index]


def test_a_kept_alive_connection_may_idle_past_the_header_timeout(strict: RunningServer) -> None:
    # The headers' deadline runs from a request's first byte; idling between requests is
    # bounded by uvicorn's keep-alive timeout (5 s) instead.
    with _connect(strict) as sock:
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_TIMEOUT_S + SLACK_S)
        assert _get_health(sock).startswith(b"HTTP/1.1 200")


def test_deadlines_must_be_positive() -> None:
    for value in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="header_timeout_s"):
            ServerConfig(header_timeout_s=value)
        with pytest.raises(ValueError, match="body_timeout_s"):
            ServerConfig(body_timeout_s=value)


def test_a_malformed_request_head_gets_an_openai_error_and_the_server_goes_on(
    strict: RunningServer,
) -> None:
    with _connect(strict) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        response = _read_all(sock)
    head = response.partition(b"\r\n\r\n")[0].lower()
    assert b"content-type: application/json" in head
    status, error = _status_and_error(response)
    assert status == 400 and error["code"] == "malformed_request"
    assert error["type"] == "invalid_request_error"
    assert httpx.get(f"{strict.base_url}/health", timeout=5).status_code == 200
