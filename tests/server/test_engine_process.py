"""The engine steps in a process of its own (graphguard/server/engine_process.py): it sends one
message a step for all of its requests, the graphs' metrics cross over to /metrics, and its
death is an error the clients see at once, not a hang."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import replace

import httpx
import psutil
import pytest

from graphguard.server.engine_client import EngineProcessClient

from .conftest import TEST_ENGINE, serve
from .helpers import MODEL, BackgroundStream, RunningServer, wait_for

NUM_STREAMS = 4
NUM_TOKENS = 8


def _client(server: RunningServer) -> EngineProcessClient:
    assert isinstance(server.engine, EngineProcessClient)
    return server.engine


def test_the_engine_runs_in_a_child_process_of_the_server(server: RunningServer) -> None:
    pid = _client(server).pid
    assert pid != os.getpid()
    assert psutil.Process(pid).ppid() == os.getpid()


def test_a_step_sends_one_message_for_all_of_its_streams(server: RunningServer) -> None:
    client = _client(server)
    messages_before = client.num_step_messages
    steps_before = server.engine.stats()["num_steps"]
    body = {"model": MODEL, "max_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0}
    prompts = [f"Count from {i}:" for i in range(NUM_STREAMS)]
    reply = httpx.post(
        f"{server.base_url}/v1/completions", json={**body, "prompt": prompts}, timeout=60
    ).json()
    assert reply["usage"]["completion_tokens"] == NUM_STREAMS * NUM_TOKENS
    num_messages = client.num_step_messages - messages_before
    num_steps = server.engine.stats()["num_steps"] - steps_before
    # at most one message a step, and far fewer than one a token
    assert 0 < num_messages <= num_steps < NUM_STREAMS * NUM_TOKENS


def test_stats_after_an_abort_reach_metrics_without_a_step(server: RunningServer) -> None:
    baseline = server.sample("graphguard_server_kv_blocks_used")
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 600, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events)
        next(events)
    assert wait_for(lambda: server.sample("graphguard_server_kv_blocks_used") == baseline, 5)


@pytest.fixture(scope="module")
def graph_process_server() -> Iterator[RunningServer]:
    config = replace(TEST_ENGINE, max_num_seqs=4, graphs=replace(TEST_ENGINE.graphs, backend="sim"))
    yield from serve(None, config)


def test_graph_metrics_and_report_come_from_the_engine_process(
    graph_process_server: RunningServer,
) -> None:
    server = graph_process_server
    server.openai(timeout=60).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    body = httpx.get(f"{server.base_url}/v1/graphs", timeout=30).json()
    assert body["enabled"] is True and body["replays"] > 0
    assert server.sample("graphguard_replays_total") > 0  # the engine process's registry


@pytest.fixture()
def doomed_server() -> Iterator[RunningServer]:
    """A server of its own whose engine process the test kills."""
    yield from serve(None, TEST_ENGINE)


def test_a_killed_engine_process_fails_streams_and_health(doomed_server: RunningServer) -> None:
    server = doomed_server
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 600, "ignore_eos": True}
    stream = BackgroundStream(f"{server.base_url}/v1/completions", {**body, "stream": True})
    assert stream.first_line.wait(30)
    os.kill(_client(server).pid, signal.SIGKILL)
    assert stream.ended(30)  # rather than hung
    lines = stream.lines
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "engine process exited" in error["message"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503
    refused = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 503 and "engine process exited" in refused.text
