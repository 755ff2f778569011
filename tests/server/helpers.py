"""Helpers shared by the server tests: the served model, free ports, polling, scraping, a
stream read in the background."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from graphguard.engine.engine import LLMEngine
from graphguard.engine.tokens.tokenizer import Tokenizer
from graphguard.server.served import ServedEngine

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = "1, 2, 3, 4,"  # greedy continues " 5, 6, 7, 8," (the embedded model)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RunningServer:
    base_url: str
    engine: ServedEngine  # what the endpoints call: stats() as /metrics sees them
    in_process: LLMEngine | None = None  # the engine itself, when it steps in this process

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.info.tokenizer

    def openai(self, **kwargs: Any) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)

    def scrape(self) -> Samples:
        """/metrics as {(sample name, labels): value}, parsed by prometheus_client."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def sample(self, name: str, **labels: str) -> float:
        return self.scrape().get((name, frozenset(labels.items())), 0.0)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `predicate()` until it is true or `timeout_s` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class BackgroundStream:
    """A streamed POST `body` to `url`, read on a thread of its own: its non-empty lines, an
    event set at the first one, and the error that cut it, if one did."""

    def __init__(self, url: str, body: dict[str, Any], timeout_s: float = 30) -> None:
        self.lines: list[str] = []
        self.first_line = threading.Event()
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._read, args=(url, body, timeout_s))
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any], timeout_s: float) -> None:
        # NOTE: the error is kept, not raised: a thread's traceback, formatted while the test's
        # own failure is, can break pytest's report on Python 3.11 (an AST recursion check)
        try:
            with httpx.stream("POST", url, json=body, timeout=timeout_s) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first_line.set()
        except Exception as error:  # noqa: BLE001 (the test reads it)
            self.error = error

    def ended(self, timeout_s: float) -> bool:
        """Whether the stream ended within `timeout_s` (rather than hung)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def ended_cleanly(self, timeout_s: float) -> bool:
        """Whether the stream ended within `timeout_s` with its last event, not cut."""
        return self.ended(timeout_s) and self.error is None and self.lines[-1:] == ["data: [DONE]"]


def post(server: RunningServer, path: str, timeout_s: float = 120, **fields: Any) -> httpx.Response:
    """POST `fields` to `path` (CHAT or COMPLETIONS) for the served model, with QUESTION or
    COUNTING where the fields bring no messages or prompt."""
    body = {"model": MODEL, **fields}
    if path == CHAT:
        body.setdefault("messages", QUESTION)
    else:
        body.setdefault("prompt", COUNTING)
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=timeout_s)


def ok(server: RunningServer, path: str, timeout_s: float = 120, **fields: Any) -> dict[str, Any]:
    """`post`'s answer, asserted a 200."""
    response = post(server, path, timeout_s, **fields)
    assert response.status_code == 200, response.text
    return dict(response.json())
