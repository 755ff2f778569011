"""The control of bench/hostile_input.py: its sink reads every body whole before it answers,
so the control phase costs the client at least the work of the hostile one, and its client
keeps its pace and counts what it uploaded."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from bench.hostile_input import FIVE_MB, SINK_ANSWER, payload, send, sink_process

BODY = b"x" * FIVE_MB
PIECE = 1 << 20


@pytest.fixture(scope="module")
def sink_url() -> Iterator[str]:
    with sink_process() as url:
        yield url


def _upload(url: str, head: bytes, pieces: list[bytes]) -> bytes:
    """Sends `head` then `pieces`, checking that nothing is answered before the last one is
    sent; the answer."""
    address = ("127.0.0.1", urlsplit(url).port)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(head)
        for piece in pieces:
            assert not select.select([sock], [], [], 0)[0], "answered before the body ended"
            sock.sendall(piece)
        return sock.recv(1024)


def test_the_sink_answers_a_declared_body_once_it_has_read_all_of_it(sink_url: str) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % FIVE_MB
    pieces = [BODY[i : i + PIECE] for i in range(0, FIVE_MB, PIECE)]
    assert _upload(sink_url, head, pieces) == SINK_ANSWER


def test_the_sink_answers_a_chunked_body_after_its_last_chunk(sink_url: str) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [b"%x\r\n%s\r\n" % (PIECE, BODY[i : i + PIECE]) for i in range(0, FIVE_MB, PIECE)]
    assert _upload(sink_url, head, [*chunks, b"0\r\n\r\n"]) == SINK_ANSWER


@pytest.mark.parametrize("kind", ["declared_5mb", "chunked_5mb"])
def test_the_client_keeps_its_pace_and_counts_its_uploads(sink_url: str, kind: str) -> None:
    sent = send(sink_url, kind, seconds=0.5, requests_per_s=10)
    assert sent["statuses"] == {"413": 5}
    assert sent["uploaded_bytes"] == 5 * len(payload(kind)[0])
