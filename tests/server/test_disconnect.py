"""A client that goes away aborts its request: its sequence and KV blocks are freed at once."""

from __future__ import annotations

import time

import httpx
import pytest

from .helpers import MODEL, RunningServer, wait_for

KV_USED = "graphguard_server_kv_blocks_used"
RUNNING = "graphguard_server_requests_running"
# Long enough that finishing naturally takes far longer than the abort is given (~25 ms/token).
LONG_MAX_TOKENS = 600
LONG_PROMPT = "Write a very long story about a lighthouse."


def _long_request(stream: bool, prompt: str | list[str] = LONG_PROMPT) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


def engine_tokens(server: RunningServer) -> int:
    return int(server.engine.stats()["num_generated_tokens"])


def assert_engine_stopped_generating(server: RunningServer, before: int) -> None:
    """The engine itself (not just the handler) stopped: no token is produced any more."""
    settled = engine_tokens(server)
    time.sleep(0.5)
    assert engine_tokens(server) == settled
    assert settled - before < LONG_MAX_TOKENS


def test_stream_disconnect_returns_kv_blocks_to_baseline(server: RunningServer) -> None:
    baseline = server.sample(KV_USED)
    generated_before = engine_tokens(server)
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=_long_request(stream=True), timeout=30) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert server.sample(KV_USED) > baseline  # the request holds blocks while it runs
    # Leaving the block closed the connection mid-stream.
    assert wait_for(lambda: server.sample(KV_USED) == baseline, timeout_s=5)
    assert wait_for(lambda: server.sample(RUNNING) == 0, timeout_s=5)
    assert_engine_stopped_generating(server, generated_before)


def test_non_streaming_disconnect_returns_kv_blocks_to_baseline(server: RunningServer) -> None:
    baseline = server.sample(KV_USED)
    generated_before = engine_tokens(server)
    url = f"{server.base_url}/v1/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=_long_request(stream=False), timeout=httpx.Timeout(30, read=1.0))
    assert wait_for(lambda: server.sample(KV_USED) == baseline, timeout_s=5)
    assert_engine_stopped_generating(server, generated_before)


def test_disconnect_aborts_every_prompt_of_a_request(server: RunningServer) -> None:
    baseline = server.sample(KV_USED)
    generated_before = engine_tokens(server)
    url = f"{server.base_url}/v1/completions"
    body = _long_request(stream=True, prompt=[LONG_PROMPT, "Tell me about the sea."])
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(4):
            next(events)
        assert server.sample(RUNNING) == 2  # both prompts run, each its own request
    assert wait_for(lambda: server.sample(KV_USED) == baseline, timeout_s=5)
    assert wait_for(lambda: server.sample(RUNNING) == 0, timeout_s=5)
    assert_engine_stopped_generating(server, generated_before)
