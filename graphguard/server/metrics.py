"""Server metrics, in a CollectorRegistry of their own so two servers never share counters.

Names follow `graphguard_server_<thing>_<unit>`. Labels are bounded: `endpoint` is a route
template (unknown paths count as "other") and `status` an HTTP status code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds. TTFT on a CPU spans tens of milliseconds to seconds under load; TPOT is per token.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class RequestTrace:
    """Timing and token counts of one generation request, recorded once when it ends."""

    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    is_recorded: bool = False

    def on_output(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        now = time.perf_counter()
        if num_output_tokens > self.num_output_tokens:
            if self.first_token_s is None:
                self.first_token_s = now
            self.last_token_s = now
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens


class ServerMetrics:
    """The collectors the server updates; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "graphguard_server_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "graphguard_server_time_to_first_token_seconds",
            "Seconds from request arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "graphguard_server_time_per_output_token_seconds",
            "Mean seconds between generated tokens after the first, one sample per request",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "graphguard_server_request_latency_seconds",
            "Seconds from request arrival to its last generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "graphguard_server_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "graphguard_server_generation_tokens", "Tokens generated", registry=r
        )
        self.header_timeouts = Counter(
            "graphguard_server_header_timeouts",
            "Connections closed because a request's headers did not arrive within "
            "--header-timeout-s: answered with a 408 (part of a head had come) or not (none)",
            ["response"],
            registry=r,
        )
        self._init_gauges()

    def record_header_timeout(self, answered: bool) -> None:
        """A connection closed at its header deadline (graphguard/server/timeouts.py)."""
        self.header_timeouts.labels("408" if answered else "none").inc()

    def _init_gauges(self) -> None:
        r = self.registry
        self.requests_running = Gauge(
            "graphguard_server_requests_running", "Requests being decoded", registry=r
        )
        self.requests_waiting = Gauge(
            "graphguard_server_requests_waiting", "Requests queued for prefill", registry=r
        )
        self.kv_blocks_used = Gauge(
            "graphguard_server_kv_blocks_used", "KV cache blocks held by sequences", registry=r
        )
        self.kv_blocks_capacity = Gauge(
            "graphguard_server_kv_blocks_capacity", "KV cache blocks in the pool", registry=r
        )
        self.engine_steps = Gauge(
            "graphguard_server_engine_steps", "Engine steps run since start", registry=r
        )
        self.decode_steps_ahead = Gauge(
            "graphguard_server_decode_steps_ahead",
            "Decode steps launched before the last step's tokens were read, since start "
            "(--overlap-decode)",
            registry=r,
        )
        self.prefix_cache_hit_rate = Gauge(
            "graphguard_server_prefix_cache_hit_rate",
            "Prompt tokens whose KV came from the prefix cache, over all admitted prompt tokens",
            registry=r,
        )
        self.prefix_cache_blocks = Gauge(
            "graphguard_server_prefix_cache_blocks", "KV blocks in the prefix cache", registry=r
        )

    def record_request(self, trace: RequestTrace) -> None:
        """Count a finished (or aborted) generation once; later calls are no-ops."""
        if trace.is_recorded:
            return
        trace.is_recorded = True
        self.prompt_tokens.inc(trace.num_prompt_tokens)
        self.generation_tokens.inc(trace.num_output_tokens)
        if trace.first_token_s is None or trace.last_token_s is None:
            return
        self.time_to_first_token.observe(trace.first_token_s - trace.arrival_s)
        self.request_latency.observe(trace.last_token_s - trace.arrival_s)
        if trace.num_output_tokens > 1:
            decode_s = trace.last_token_s - trace.first_token_s
            self.time_per_output_token.observe(decode_s / (trace.num_output_tokens - 1))

    def observe_engine(self, stats: dict[str, Any]) -> None:
        """Copy the engine's queue and KV gauges from a `LLMEngine.stats()` snapshot."""
        self.requests_running.set(stats.get("num_running", 0))
        self.requests_waiting.set(stats.get("num_waiting", 0))
        self.kv_blocks_used.set(stats.get("kv_blocks_used", 0))
        self.kv_blocks_capacity.set(stats.get("kv_blocks_total", 0))
        self.engine_steps.set(stats.get("num_steps", 0))
        self.decode_steps_ahead.set(stats.get("num_steps_ahead", 0))
        cache = stats.get("prefix_cache") or {}
        self.prefix_cache_hit_rate.set(cache.get("hit_rate", 0.0))
        self.prefix_cache_blocks.set(cache.get("cached_blocks", 0))

    def render(self, graph_registry: CollectorRegistry | None) -> bytes:
        """Prometheus text: the server's metrics, then the graph runtime's when it is on."""
        body = generate_latest(self.registry)
        if graph_registry is not None:
            body += generate_latest(graph_registry)
        return body
