"""Prometheus collectors for graph runners.

Labels come only from closed sets (capture outcomes, FallbackReason, eviction causes), so the
series count is bounded. One GraphMetrics may be shared by several runners (an engine's decode
and prefill runners, say): gauges move by deltas, never by absolute sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from graphguard.core.reasons import ALL_REASONS, CaptureOutcome, EvictionCause

PREWARM_OUTCOMES = ("prewarmed", "skipped")
PREWARM_REFUSALS = ("unreadable", "version", "torch", "device", "model")


class GraphMetrics:
    """The runtime's collectors, registered in `registry` (a private one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.captures = Counter(
            "graphguard_captures", "Graph captures by outcome", ["outcome"], registry=r
        )
        self.replays = Counter("graphguard_replays", "Graph replays", registry=r)
        self.calls = Counter("graphguard_calls", "Calls into graph runners", registry=r)
        self.fallbacks = Counter(
            "graphguard_fallbacks", "Calls run eagerly, by reason", ["reason"], registry=r
        )
        self.evictions = Counter(
            "graphguard_evictions", "Graphs retired from the cache, by cause", ["cause"], registry=r
        )
        self.capture_seconds = Histogram(
            "graphguard_capture_seconds",
            "Warm-up + capture + parity check time per graph",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.thrash_backoffs = Counter(
            "graphguard_thrash_backoffs", "Keys backed off for eviction thrash", registry=r
        )
        self.resident_bytes = Gauge(
            "graphguard_graph_resident_bytes", "Device bytes held by admitted graphs", registry=r
        )
        self.host_bytes = Gauge(
            "graphguard_graph_pinned_host_bytes", "Pinned host staging bytes", registry=r
        )
        self.budget_bytes = Gauge(
            "graphguard_graph_budget_bytes", "Sum of the runners' byte budgets", registry=r
        )
        self.entries = Gauge("graphguard_graph_entries", "Admitted graphs", registry=r)
        self.quarantined = Gauge(
            "graphguard_quarantined_keys", "Keys backing off after a failure", registry=r
        )
        self.prewarm_seconds = Gauge(
            "graphguard_prewarm_seconds", "Time the last prewarm from a manifest took", registry=r
        )
        self.prewarm_keys = Counter(
            "graphguard_prewarm_keys", "Manifest keys by prewarm outcome", ["outcome"], registry=r
        )
        self.prewarm_refusals = Counter(
            "graphguard_prewarm_refusals", "Manifests refused, by reason", ["reason"], registry=r
        )
        for outcome in PREWARM_OUTCOMES:
            self.prewarm_keys.labels(outcome)
        for refusal in PREWARM_REFUSALS:
            self.prewarm_refusals.labels(refusal)
        for outcome in CaptureOutcome:
            self.captures.labels(outcome.value)
        for reason in ALL_REASONS:
            self.fallbacks.labels(reason.value)
        for cause in EvictionCause:
            self.evictions.labels(cause.value)
