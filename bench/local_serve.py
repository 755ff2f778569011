"""`graphguard serve` as the benches run it: started in a process of its own on a free loopback
port, asked for streamed completions, and their streams read as a client reads them
(bench/serve_load.py, bench/serve_vs_offline.py, bench/hostile_input.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import httpx


class LocalServer(NamedTuple):
    url: str
    pid: int
    start_s: float  # launch to a healthy server (load, KV, graph warm-up if asked)


@contextmanager
def local_serve(
    flags: list[str], *, timeout_s: float = 600, pythonpath: str | None = None
) -> Iterator[LocalServer]:
    """`graphguard serve <flags>` on a free loopback port, once /health answers, until the
    block ends (SIGINT, then a kill after 60 s). `pythonpath`: serve the graphguard found there
    (run from that folder). Exits the bench if the server ends or is not healthy in time."""
    port = free_port()
    command = [sys.executable, "-m", "graphguard.server.cli", "--port", str(port), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=pythonpath or None)
    url = f"http://127.0.0.1:{port}"
    try:
        while not _healthy(url):
            if process.poll() is not None:
                sys.exit(f"graphguard serve exited with {process.returncode} before it served")
            if time.perf_counter() - started > timeout_s:
                sys.exit(f"graphguard serve was not healthy after {timeout_s:g} s")
            time.sleep(0.1)
        yield LocalServer(url, process.pid, round(time.perf_counter() - started, 2))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stream_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed /v1/completions body of exactly `max_tokens` tokens (EOS ignored),
    its last chunk the usage."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class StreamReading:
    """What a client reads from a streamed /v1/completions: when the first and the last text
    arrived and how many tokens the usage chunk counted. Feed it the lines as they arrive."""

    def __init__(self) -> None:
        self.first_text_s: float | None = None  # time.perf_counter() of the first text
        self.last_text_s: float | None = None
        self.num_tokens = 0  # completion tokens, from the usage chunk

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line.removeprefix("data: "))
        if chunk.get("usage"):
            self.num_tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["text"]:
            self.last_text_s = time.perf_counter()
            self.first_text_s = self.first_text_s or self.last_text_s
