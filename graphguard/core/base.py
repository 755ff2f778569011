"""What every runner of graphs shares: the gate, admission, the byte-budget cache, the
bookkeeping of captures, rejections and evictions, and the lifecycle (invalidate, close).

GraphRunner keys single graphs; SegmentedRunner keys groups of segment graphs. Both subclass
RunnerBase so that one set of rules (deny by default, one FallbackReason per fallback, the
admission policy, quarantine, metrics) serves both.

Lock order: an engine's lifecycle lock, then the runner's lock, then its cache's lock.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from graphguard.core.admission import AdmissionConfig, AdmissionPolicy, Clock
from graphguard.core.backends import Backend, CudaBackend
from graphguard.core.cache import GraphCache
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import CaptureOutcome, EvictionCause, FallbackReason
from graphguard.core.sim import SimBackend
from graphguard.core.verify import VerifyConfig, describe_mismatch, outputs_match

log = logging.getLogger("graphguard")

KILL_SWITCH_ENV = "GRAPHGUARD_DISABLE"
_TRUTHY = {"1", "true", "yes", "on"}


class ParityError(RuntimeError):
    """Raised in strict mode when a graph's output differs from eager."""


class Retirable(Protocol):
    """A graph entry or a group of segment graphs."""

    @property
    def key(self) -> GraphKey: ...
    @property
    def resident_bytes(self) -> int: ...
    def retire(self) -> bool: ...


def kill_switch_on() -> bool:
    """GRAPHGUARD_DISABLE=1 (read on every call) turns every graph off."""
    value = os.environ.get(KILL_SWITCH_ENV)
    return value is not None and value.strip().lower() in _TRUTHY


def resolve_backend(backend: str | Backend, device: Any = None) -> Backend | None:
    """ "auto" is CUDA when present and None (every call falls back with no_cuda) otherwise."""
    if not isinstance(backend, str):
        return backend
    if backend == "sim":
        return SimBackend()
    if backend == "cuda":
        return CudaBackend(device)
    if backend == "auto":
        return CudaBackend(device) if torch.cuda.is_available() else None
    raise ValueError(f"backend must be 'auto', 'cuda', 'sim' or a Backend, got {backend!r}")


@dataclass
class RunnerStats:
    calls: int = 0
    replays: int = 0
    captures: int = 0
    capture_failures: int = 0
    parity_mismatches: int = 0
    evictions: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)


class RunnerBase:
    """Shared state and rules of graph runners (see module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        max_bytes: int,
        verify: VerifyConfig,
        backend: str | Backend,
        device: Any,
        admission: AdmissionConfig | None,
        strict: bool,
        copy_outputs: bool,
        retain: Sequence[Any],
        metrics: GraphMetrics | None,
        clock: Clock,
        enabled: bool,
    ):
        self.name = name
        self.verify = verify
        self.backend = resolve_backend(backend, device)
        # the backend's device, or the CPU's when there is no backend (every call falls back)
        self._device = self.backend.device if self.backend is not None else torch.device("cpu")
        self.strict = strict
        self.copy_outputs = copy_outputs
        self.clock = clock
        self.enabled = enabled
        self.metrics = metrics if metrics is not None else GraphMetrics()
        self.policy = AdmissionPolicy(admission or AdmissionConfig(), clock)
        self._cache = GraphCache(max_bytes, on_evict=self._on_evict)
        self._owners = list(retain)
        self._lock = threading.RLock()
        self._closed = False
        self._stats = RunnerStats()
        # NOTE: fallbacks are counted outside the runner's lock (eager work runs unlocked), so
        # the counters have a small lock of their own.
        self._stats_lock = threading.Lock()
        self._gauge_last = (0, 0, 0, 0)  # resident bytes, graphs, host bytes, quarantined keys
        self.metrics.budget_bytes.inc(max_bytes)

    # -- deciding --------------------------------------------------------------------------
    def _gate(self) -> FallbackReason | None:
        if kill_switch_on():
            return FallbackReason.KILL_SWITCH
        if not self.enabled:
            return FallbackReason.DISABLED
        if self.backend is None:
            return FallbackReason.NO_CUDA
        if self._closed:
            return FallbackReason.CLOSED
        return None

    def _admission_reason(self, key: GraphKey) -> FallbackReason | None:
        reason = self.policy.blocked(key)
        if reason is not None:
            return reason
        hint = self.policy.size_hints.get(key)
        if hint is not None and hint > self._cache.max_bytes:
            return FallbackReason.OVER_BUDGET
        victims = self._cache.victims_for(self._expected_bytes(key))
        if victims is None:
            return FallbackReason.ADMISSION_DEFERRED
        if victims and not self.policy.worth_evicting(key, [v.key for v in victims]):
            return FallbackReason.ADMISSION_DEFERRED
        return None

    def _expected_bytes(self, key: GraphKey) -> int:
        """What a capture of `key` is expected to hold: its last size, else the mean entry's."""
        hint = self.policy.size_hints.get(key)
        return hint if hint is not None else self._cache.mean_entry_bytes()

    def _parity_error(self, key: GraphKey, graph_out: Any, eager_out: Any) -> ParityError | None:
        """The error to reject a candidate with when its output differs from eager's."""
        if outputs_match(graph_out, eager_out, self.verify):
            return None
        detail = describe_mismatch(graph_out, eager_out)
        return ParityError(f"graph output differs from eager for {key.describe()}: {detail}")

    # -- bookkeeping -----------------------------------------------------------------------
    # NOTE: every call is counted exactly once, as a replay or as one fallback, so
    # calls == replays + fallbacks holds by construction.
    def _count_fallback(self, reason: FallbackReason) -> None:
        self.metrics.calls.inc()
        self.metrics.fallbacks.labels(reason.value).inc()
        with self._stats_lock:
            fallbacks = self._stats.fallbacks
            fallbacks[reason.value] = fallbacks.get(reason.value, 0) + 1

    def _count_replay(self) -> None:
        # NOTE: replays are counted under the runner's lock, so no counter lock is needed.
        self.metrics.calls.inc()
        self.metrics.replays.inc()
        self._stats.replays += 1

    def _count_capture(self, key: GraphKey, seconds: float, resident_bytes: int) -> None:
        """A verified capture about to be admitted: admission history and capture metrics."""
        backoffs = self.policy.counters.thrash_backoffs
        self.policy.record_capture(key, seconds, resident_bytes)
        self.metrics.thrash_backoffs.inc(self.policy.counters.thrash_backoffs - backoffs)
        self.metrics.capture_seconds.observe(seconds)

    def _count_admitted(self, served: bool = True) -> None:
        """An admitted capture; `served` when its verified first replay answered a call
        (warm-up and prewarm captures answer none)."""
        with self._stats_lock:
            self._stats.captures += 1
        if served:
            self._count_replay()
        self.metrics.captures.labels(CaptureOutcome.ADMITTED.value).inc()
        self._sync_gauges()

    def _reject(
        self,
        candidate: Retirable,
        outcome: CaptureOutcome,
        reason: FallbackReason,
        error: Exception | None,
    ) -> FallbackReason:
        """Retire a candidate that failed capture, parity or the budget; quarantine failures."""
        candidate.retire()
        assert self.backend is not None
        self.backend.trim()
        self.metrics.captures.labels(outcome.value).inc()
        if outcome is CaptureOutcome.OVER_BUDGET:
            log.info(
                "graphguard over_budget key=%s bytes=%d budget=%d runner=%s",
                candidate.key.describe(), candidate.resident_bytes, self._cache.max_bytes,
                self.name,
            )  # fmt: skip
            return reason
        with self._stats_lock:
            if outcome is CaptureOutcome.FAILED:
                self._stats.capture_failures += 1
            else:
                self._stats.parity_mismatches += 1
        self._quarantine(candidate.key, f"{outcome}: {error}")
        if self.strict and error is not None:
            raise error
        return reason

    def _quarantine(self, key: GraphKey, why: str) -> None:
        delay = self.policy.quarantine(key)
        self._sync_gauges()
        log.warning(
            "graphguard quarantine key=%s backoff_s=%.1f why=%s", key.describe(), delay, why
        )

    def _on_evict(self, entry: Any, cause: EvictionCause) -> None:
        with self._stats_lock:
            self._stats.evictions += 1
        self.metrics.evictions.labels(cause.value).inc()
        if cause is EvictionCause.BUDGET:
            self.policy.record_eviction(entry.key)
        if cause in (EvictionCause.BUDGET, EvictionCause.REVERIFY) and self.backend is not None:
            # NOTE: the evicted pool is released; trimming hands its reserved bytes back now,
            # so the device really holds no more than the budget says.
            self.backend.trim()
        self._sync_gauges()

    # -- lifecycle and introspection -------------------------------------------------------
    def invalidate(self, cause: EvictionCause | str = EvictionCause.INVALIDATE) -> int:
        """Retire every graph (weights reloaded, say). Returns how many were retired."""
        with self._lock:
            count = self._cache.clear(cause)
            if self.backend is not None:
                self.backend.trim()
            return count

    def close(self) -> None:
        """Retire every graph; later calls run eagerly (reason `closed`). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self.invalidate(EvictionCause.CLOSE)
            self._closed = True
            self.metrics.budget_bytes.dec(self._cache.max_bytes)

    def _num_graphs(self) -> int:
        return len(self._cache)

    def _host_bytes(self) -> int:
        return sum(getattr(e, "host_bytes", 0) for e in self._cache.entries())

    def _sync_gauges(self) -> None:
        # NOTE: gauges may be shared by several runners, so they move by this runner's delta.
        now = (
            self._cache.resident_bytes,
            self._num_graphs(),
            self._host_bytes(),
            self.policy.num_quarantined(),
        )
        last, self._gauge_last = self._gauge_last, now
        self.metrics.resident_bytes.inc(now[0] - last[0])
        self.metrics.entries.inc(now[1] - last[1])
        self.metrics.host_bytes.inc(now[2] - last[2])
        self.metrics.quarantined.inc(now[3] - last[3])

    def _base_stats(self) -> dict[str, Any]:
        self._sync_gauges()  # quarantines expire with time, not with an event
        with self._stats_lock:
            stats = asdict(self._stats)
        stats["calls"] = stats["replays"] + sum(stats["fallbacks"].values())
        stats.update(
            name=self.name,
            backend=self.backend.name if self.backend is not None else None,
            closed=self._closed,
            resident_bytes=self._cache.resident_bytes,
            max_bytes=self._cache.max_bytes,
            host_bytes=self._host_bytes(),
            quarantined_keys=self.policy.num_quarantined(),
            hit_rate=round(stats["replays"] / (stats["calls"] or 1), 4),
            admission=asdict(self.policy.counters),
        )
        return stats
