"""The server with decode graphs on (SimBackend on CPU): /v1/graphs and /metrics show them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from graphguard.engine.engine import LLMEngine

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import RunningServer

GRAPH_ENGINE = replace(
    TEST_ENGINE, max_num_seqs=4, graphs=replace(TEST_ENGINE.graphs, backend="sim")
)


@pytest.fixture(scope="module")
def graph_server(engine: LLMEngine) -> Iterator[RunningServer]:
    graph_engine = engine_sharing_weights(engine, GRAPH_ENGINE)
    yield from serve(graph_engine, GRAPH_ENGINE)


def ask_paris(server: RunningServer) -> str:
    reply = server.openai(timeout=60).chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,
    )
    return reply.choices[0].message.content or ""


def test_greedy_answers_are_unchanged_with_graphs_on(
    graph_server: RunningServer, server: RunningServer
) -> None:
    assert not server.engine.info.has_graph_metrics  # the reference server runs eagerly
    answer = ask_paris(graph_server)
    assert answer == ask_paris(server) and "Paris" in answer
    assert graph_server.in_process.graphs.stats()["replays"] > 0


def test_graphs_endpoint_lists_the_resident_decode_graphs(graph_server: RunningServer) -> None:
    ask_paris(graph_server)
    body = httpx.get(f"{graph_server.base_url}/v1/graphs").json()
    assert body["enabled"] is True and body["reason"] == "enabled"
    assert body["replays"] > 0 and body["graphs"] and body["resident_bytes"] > 0
    assert body["kv_bytes"] == graph_server.in_process.kv.kv_bytes
    # The prefill graphs report beside them, with the calls that reached them.
    assert body["prefill"] is not None and body["prefill"]["calls"] > 0
    decode_keys = set(graph_server.in_process.graphs.stats()) - {"prefill"}
    assert decode_keys <= set(body)


def test_metrics_carry_the_graph_runtime_counters(graph_server: RunningServer) -> None:
    ask_paris(graph_server)
    text = httpx.get(f"{graph_server.base_url}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    graph_families = {f.name for f in graph_server.in_process.graphs.registry.collect()}
    assert "graphguard_replays" in graph_families and graph_families <= families
    samples = graph_server.scrape()
    assert samples[("graphguard_replays_total", frozenset())] > 0
    assert samples[("graphguard_graph_resident_bytes", frozenset())] > 0
