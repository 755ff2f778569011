"""How a stream's bytes are framed on the wire: the end of a stream (the last chunk, the usage,
`[DONE]`) is one HTTP chunk, one write, read here with h11 so the chunk boundaries show."""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlparse

import h11

from .helpers import MODEL, RunningServer


def _http_chunks(base_url: str, body: dict[str, Any]) -> list[bytes]:
    """The HTTP/1.1 chunks of a streamed answer to `body`, each whole, in order."""
    url = urlparse(base_url)
    payload = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    headers = [
        ("host", url.netloc),
        ("content-type", "application/json"),
        ("content-length", str(len(payload))),
    ]
    chunks: list[bytes] = []
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        for event in (
            h11.Request(method="POST", target="/v1/completions", headers=headers),
            h11.Data(data=payload),
            h11.EndOfMessage(),
        ):
            sock.sendall(conn.send(event) or b"")
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                if event.chunk_start:
                    chunks.append(b"")
                chunks[-1] += event.data
            elif isinstance(event, h11.EndOfMessage):
                return chunks


def _events(chunk: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in chunk.decode().split("\n\n") if e]


def test_the_last_chunk_the_usage_and_done_go_out_as_one_http_chunk(
    server: RunningServer,
) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _http_chunks(server.base_url, body)

    *last_chunk, usage_chunk, done = _events(chunks[-1])
    assert done == "[DONE]" and len(last_chunk) == 1
    assert json.loads(last_chunk[0])["choices"][0]["finish_reason"] == "length"
    assert json.loads(usage_chunk)["usage"]["completion_tokens"] == 4
    # every other HTTP chunk is one event of text
    for chunk in chunks[:-1]:
        (event,) = _events(chunk)
        assert json.loads(event)["choices"][0]["finish_reason"] is None


def test_with_two_choices_the_one_that_ends_last_goes_out_with_done(
    server: RunningServer,
) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "n": 2, "ignore_eos": True}
    chunks = _http_chunks(server.base_url, {**body, "stream": True, "temperature": 0.0})

    *last_chunk, done = _events(chunks[-1])
    assert done == "[DONE]" and len(last_chunk) == 1
    finishes = [
        (choice["index"], choice["finish_reason"])
        for chunk in chunks
        for event in _events(chunk)
        if event != "[DONE]"
        for choice in json.loads(event)["choices"]
        if choice["finish_reason"] is not None
    ]
    # the choice that ended first was sent when it ended, not held for the other
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert json.loads(last_chunk[0])["choices"][0]["finish_reason"] == "length"
    assert all(len(_events(chunk)) == 1 for chunk in chunks[:-1])
