"""Prometheus collectors for graph runners, and one runner's counts (its stats()).

Labels come only from closed sets (capture outcomes, FallbackReason, eviction causes, prewarm
outcomes and refusals), so the series count is bounded. One GraphMetrics may be shared by
several runners (an engine's decode and prefill runners, say): gauges move by deltas, never by
absolute sets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from graphguard.core.reasons import (
    ALL_REASONS,
    CaptureOutcome,
    EvictionCause,
    FallbackReason,
    PrewarmOutcome,
    PrewarmRefusal,
)


class _Calls(Collector):
    """graphguard_calls_total: the replays plus the fallbacks of every reason."""

    def __init__(self, replays: Counter, fallbacks: Counter) -> None:
        self._counters = (replays, fallbacks)

    def collect(self) -> Iterator[CounterMetricFamily]:
        total = sum(
            sample.value
            for counter in self._counters
            for family in counter.collect()
            for sample in family.samples
            if sample.name.endswith("_total")
        )
        yield CounterMetricFamily("graphguard_calls", "Calls into graph runners", value=total)


class GraphMetrics:
    """The runtime's collectors, registered in `registry` (a private one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._counters(self.registry)
        self._gauges(self.registry)
        self._prewarm(self.registry)
        self._label_values()

    def _counters(self, r: CollectorRegistry) -> None:
        self.captures = Counter(
            "graphguard_captures", "Graph captures by outcome", ["outcome"], registry=r
        )
        self.replays = Counter("graphguard_replays", "Graph replays", registry=r)
        self.fallbacks = Counter(
            "graphguard_fallbacks", "Calls run eagerly, by reason", ["reason"], registry=r
        )
        # NOTE: every call is a replay or one fallback, so the call count is their sum, read
        # when scraped: a replay pays for one counter, not two.
        r.register(_Calls(self.replays, self.fallbacks))
        self.evictions = Counter(
            "graphguard_evictions", "Graphs retired from the cache, by cause", ["cause"], registry=r
        )
        self.capture_seconds = Histogram(
            "graphguard_capture_seconds",
            "Warm-up + capture + parity check time per admitted graph (its units' time when "
            "captured between calls)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.thrash_backoffs = Counter(
            "graphguard_thrash_backoffs", "Keys backed off for eviction thrash", registry=r
        )

    def _gauges(self, r: CollectorRegistry) -> None:
        self.resident_bytes = Gauge(
            "graphguard_graph_resident_bytes", "Device bytes held by admitted graphs", registry=r
        )
        self.host_bytes = Gauge(
            "graphguard_graph_pinned_host_bytes", "Pinned host staging bytes", registry=r
        )
        self.budget_bytes = Gauge(
            "graphguard_graph_budget_bytes", "Sum of the runners' byte budgets", registry=r
        )
        self.reserved_bytes = Gauge(
            "graphguard_graph_reserved_bytes",
            "Device bytes held for captures in flight between calls",
            registry=r,
        )
        self.entries = Gauge("graphguard_graph_entries", "Admitted graphs", registry=r)
        self.quarantined = Gauge(
            "graphguard_quarantined_keys", "Keys backing off after a failure", registry=r
        )

    def _prewarm(self, r: CollectorRegistry) -> None:
        self.prewarm_seconds = Gauge(
            "graphguard_prewarm_seconds", "Time the last prewarm from a manifest took", registry=r
        )
        self.prewarm_keys = Counter(
            "graphguard_prewarm_keys", "Manifest keys by prewarm outcome", ["outcome"], registry=r
        )
        self.prewarm_refusals = Counter(
            "graphguard_prewarm_refusals", "Manifests refused, by reason", ["reason"], registry=r
        )

    def _label_values(self) -> None:
        """Every label value of a closed set exists from the start (a zero, not a gap)."""
        for prewarm_outcome in PrewarmOutcome:
            self.prewarm_keys.labels(prewarm_outcome.value)
        for refusal in PrewarmRefusal:
            self.prewarm_refusals.labels(refusal.value)
        for outcome in CaptureOutcome:
            self.captures.labels(outcome.value)
        for reason in ALL_REASONS:
            self.fallbacks.labels(reason.value)
        for cause in EvictionCause:
            self.evictions.labels(cause.value)


@dataclass
class RunnerStats:
    calls: int = 0
    replays: int = 0
    covered: int = 0  # of the replays: calls answered by a larger bucket's graph
    captures: int = 0
    capture_failures: int = 0
    parity_mismatches: int = 0
    captures_cancelled: int = 0
    state_refusals: int = 0  # keys refused for state a capture cannot put back
    evictions: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)


class RunnerCounts:
    """One runner's counts, kept in its RunnerStats and in the (maybe shared) collectors.

    NOTE: every call is counted exactly once, as a replay or as one fallback, so
    calls == replays + fallbacks holds by construction.
    """

    def __init__(self, metrics: GraphMetrics):
        self.metrics = metrics
        self.stats = RunnerStats()
        # NOTE: fallbacks are counted outside the runner's lock (eager work runs unlocked), so
        # the counts have a small lock of their own.
        self.lock = threading.Lock()
        # resident bytes, graphs, host bytes, quarantined keys, reserved bytes
        self._gauges = (0, 0, 0, 0, 0)

    def fallback(self, reason: FallbackReason) -> None:
        self.metrics.fallbacks.labels(reason.value).inc()
        with self.lock:
            fallbacks = self.stats.fallbacks
            fallbacks[reason.value] = fallbacks.get(reason.value, 0) + 1

    def replay(self) -> None:
        # NOTE: replays are counted under the runner's lock, so no counter lock is needed.
        self.metrics.replays.inc()
        self.stats.replays += 1

    def cover(self) -> None:
        """One of the replays answered a call through a larger bucket's graph (under the
        runner's lock, as replays are counted)."""
        self.stats.covered += 1

    def capture(self, outcome: CaptureOutcome) -> None:
        """A capture that ended in `outcome`."""
        self.metrics.captures.labels(outcome.value).inc()
        with self.lock:
            if outcome is CaptureOutcome.ADMITTED:
                self.stats.captures += 1
            elif outcome is CaptureOutcome.FAILED:
                self.stats.capture_failures += 1
            elif outcome is CaptureOutcome.PARITY_MISMATCH:
                self.stats.parity_mismatches += 1
            elif outcome is CaptureOutcome.CANCELLED:
                self.stats.captures_cancelled += 1
            elif outcome is CaptureOutcome.STATE_REFUSED:
                self.stats.state_refusals += 1

    def drift(self) -> None:
        """A periodic re-verification found an admitted graph differing from eager."""
        with self.lock:
            self.stats.parity_mismatches += 1

    def eviction(self, cause: EvictionCause) -> None:
        with self.lock:
            self.stats.evictions += 1
        self.metrics.evictions.labels(cause.value).inc()

    def move_gauges(
        self,
        resident_bytes: int,
        graphs: int,
        host_bytes: int,
        quarantined: int,
        reserved_bytes: int = 0,
    ) -> None:
        """Move the shared gauges by this runner's change since the last call."""
        now = (resident_bytes, graphs, host_bytes, quarantined, reserved_bytes)
        last, self._gauges = self._gauges, now
        self.metrics.resident_bytes.inc(now[0] - last[0])
        self.metrics.entries.inc(now[1] - last[1])
        self.metrics.host_bytes.inc(now[2] - last[2])
        self.metrics.quarantined.inc(now[3] - last[3])
        self.metrics.reserved_bytes.inc(now[4] - last[4])

    def snapshot(self) -> dict[str, Any]:
        """The stats as a dict; `calls` is derived from replays and fallbacks."""
        with self.lock:
            stats = asdict(self.stats)
        stats["calls"] = stats["replays"] + sum(stats["fallbacks"].values())
        return stats
