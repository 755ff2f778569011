"""--max-request-bytes (4 MiB by default): a larger body gets a 413 before it is parsed, read
no further than the limit, while the server goes on answering others."""

from __future__ import annotations

import json
import select
import socket
from urllib.parse import urlsplit

import httpx

from graphguard.server.config import ServerConfig

from .helpers import MODEL, RunningServer

LIMIT = ServerConfig().max_request_bytes
FIVE_MB = 5_000_000
CHUNK = b"x" * (64 << 10)


def _connect(server: RunningServer) -> socket.socket:
    address = urlsplit(server.base_url)
    return socket.create_connection((address.hostname, address.port), timeout=30)


def _request_head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, object]]:
    """Status and JSON body of the response on `sock`, read until the server closes."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # the unread rest of the upload resets the connection
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _is_answered(sock: socket.socket, timeout_s: float) -> bool:
    return bool(select.select([sock], [], [], timeout_s)[0])


def test_a_declared_oversized_body_is_refused_before_it_is_sent(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_request_head("/v1/completions", f"Content-Length: {FIVE_MB}"))
        status, body = _read_response(sock)  # not one byte of the body was sent
    assert status == 413
    assert body["error"]["code"] == "request_too_large"  # type: ignore[index]


def test_a_chunked_body_is_refused_once_past_the_limit_while_health_answers(
    server: RunningServer,
) -> None:
    num_sent = 0
    with _connect(server) as sock:
        sock.sendall(_request_head("/v1/chat/completions", "Transfer-Encoding: chunked"))
        while num_sent <= LIMIT:
            assert not _is_answered(sock, 0), "answered before the body passed the limit"
            sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
            num_sent += len(CHUNK)
            if num_sent == 32 * len(CHUNK):  # 2 MiB in, the upload still going
                assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        # Past the limit, well short of the 5 MB: the answer comes without the rest.
        assert _is_answered(sock, 30) and num_sent < FIVE_MB
        status, body = _read_response(sock)
    assert status == 413
    assert body["error"]["code"] == "request_too_large"  # type: ignore[index]


def test_a_body_at_the_limit_is_parsed(server: RunningServer) -> None:
    prompt = "Hi" + " " * (LIMIT - 200)  # the body just under the limit: JSON parsing decides
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1, "n": 0})
    assert len(body) <= LIMIT
    headers = {"content-type": "application/json"}
    url = f"{server.base_url}/v1/completions"
    response = httpx.post(url, content=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"


def test_the_refusal_is_counted(server: RunningServer) -> None:
    label = {"endpoint": "/v1/completions", "status": "413"}
    before = server.sample("graphguard_server_requests_total", **label)
    with _connect(server) as sock:
        sock.sendall(_request_head("/v1/completions", f"Content-Length: {LIMIT + 1}"))
        assert _read_response(sock)[0] == 413
    assert server.sample("graphguard_server_requests_total", **label) == before + 1
