"""/metrics: Prometheus text whose counters move by exactly what was served."""

from __future__ import annotations

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from .helpers import MODEL, RunningServer

REQUESTS = "graphguard_server_requests_total"


def test_metrics_parse_as_prometheus_text(server: RunningServer) -> None:
    text = httpx.get(f"{server.base_url}/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "graphguard_server_requests",
        "graphguard_server_time_to_first_token_seconds",
        "graphguard_server_time_per_output_token_seconds",
        "graphguard_server_prompt_tokens",
        "graphguard_server_generation_tokens",
        "graphguard_server_requests_running",
        "graphguard_server_requests_waiting",
        "graphguard_server_kv_blocks_used",
        "graphguard_server_kv_blocks_capacity",
        "graphguard_server_engine_steps",
        "graphguard_server_decode_steps_ahead",
    } <= names


def test_counters_move_by_exactly_the_served_requests_and_tokens(
    client: OpenAI, server: RunningServer
) -> None:
    before = server.scrape()
    usages = []
    for max_tokens in (2, 3, 4):
        reply = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=max_tokens)
        usages.append(reply.usage)
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True)
    assert len(list(stream)) >= 1
    after = server.scrape()

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(REQUESTS, endpoint="/v1/completions", status="200") == 4
    num_prompt = sum(u.prompt_tokens for u in usages if u) + len(server.tokenizer.encode("Hello"))
    assert delta("graphguard_server_prompt_tokens_total") == num_prompt
    assert delta("graphguard_server_generation_tokens_total") == 2 + 3 + 4 + 5
    assert delta("graphguard_server_time_to_first_token_seconds_count") == 4
    assert delta("graphguard_server_time_per_output_token_seconds_count") == 4


def test_error_responses_are_counted_by_status(server: RunningServer) -> None:
    before = server.sample(REQUESTS, endpoint="/v1/completions", status="404")
    body = {"model": "no-such-model", "prompt": "hi"}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 404
    assert server.sample(REQUESTS, endpoint="/v1/completions", status="404") == before + 1


def test_kv_gauges_report_the_engine_pool(server: RunningServer) -> None:
    samples = server.scrape()
    total = server.engine.stats()["kv_blocks_total"]
    assert samples[("graphguard_server_kv_blocks_capacity", frozenset())] == total
    assert samples[("graphguard_server_kv_blocks_used", frozenset())] == 0


def test_step_gauges_report_the_engine_counts(client: OpenAI, server: RunningServer) -> None:
    client.completions.create(model=MODEL, prompt="Hi there", max_tokens=3)
    samples = server.scrape()
    stats = server.engine.stats()
    assert samples[("graphguard_server_engine_steps", frozenset())] == stats["num_steps"] >= 3
    # a CPU server steps one at a time by default (--overlap-decode auto: on with CUDA)
    assert samples[("graphguard_server_decode_steps_ahead", frozenset())] == 0


def test_prefix_cache_gauges_report_the_engine_cache(client: OpenAI, server: RunningServer) -> None:
    prompt = "The same long question, asked twice over, word for word, by two clients. " * 4
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    samples = server.scrape()
    cache = server.engine.stats()["prefix_cache"]
    assert cache["hit_tokens"] > 0 and cache["cached_blocks"] > 0
    rate = samples[("graphguard_server_prefix_cache_hit_rate", frozenset())]
    assert rate == cache["hit_rate"] > 0
    assert samples[("graphguard_server_prefix_cache_blocks", frozenset())] == cache["cached_blocks"]


def test_graphs_endpoint_says_why_graphs_are_off_on_a_cpu(server: RunningServer) -> None:
    # this server runs on the CPU without a graph backend (tests/server/test_graphs_on.py has
    # the one with graphs on)
    assert not server.engine.info.has_graph_metrics
    body = httpx.get(f"{server.base_url}/v1/graphs").json()
    assert body["enabled"] is False and body["reason"] == "no_cuda"
