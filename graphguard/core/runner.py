"""GraphRunner: the public callable.

Every call either replays an admitted graph or runs eagerly with exactly one FallbackReason.
Replays of one runner are serialized by the runner's lock (lock order: engine lifecycle lock,
then this runner's lock, then its cache's lock).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from graphguard.core.admission import AdmissionConfig, AdmissionPolicy, Clock
from graphguard.core.backends import Backend, CaptureError, CudaBackend, SimBackend
from graphguard.core.cache import GraphCache
from graphguard.core.entry import EntryInfo, GraphEntry, PoolGroup
from graphguard.core.inputs import CallPlan, copy_inputs, make_static_args, plan_call, slice_outputs
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import FallbackReason
from graphguard.core.verify import VerifyConfig, describe_mismatch, outputs_match

log = logging.getLogger("graphguard")

KILL_SWITCH_ENV = "GRAPHGUARD_DISABLE"
_TRUTHY = {"1", "true", "yes", "on"}


class ParityError(RuntimeError):
    """Raised in strict mode when a graph's output differs from eager."""


def kill_switch_on() -> bool:
    """GRAPHGUARD_DISABLE=1 (read on every call) turns every graph off."""
    return os.environ.get(KILL_SWITCH_ENV, "").strip().lower() in _TRUTHY


def resolve_backend(backend: str | Backend, device: Any = None) -> Backend | None:
    """ "auto" is CUDA when present and None (every call falls back with no_cuda) otherwise."""
    if not isinstance(backend, str):
        return backend
    if backend == "sim":
        return SimBackend()
    if backend == "cuda":
        return CudaBackend(device)
    if backend == "auto":
        import torch

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


@dataclass
class WarmupReport:
    captured: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # key -> reason
    seconds: float = 0.0


class GraphRunner:
    """Replays CUDA graphs of `fn` under a byte budget, verified against eager.

    Args:
        fn: callable on tensors (and hashable constants) returning a tensor, tuple, list or dict
            of tensors. It must not depend on host-side state that changes between calls.
        buckets: pad dimension 0 of every tensor argument up to a bucket and slice outputs back;
            without it, graphs are keyed by exact shapes, dtypes and devices.
        max_bytes: resident byte budget for all graphs of this runner.
        verify: "exact" (bitwise), "allclose" (with rtol and atol) or "off".
        reverify_every: compare every N-th replay with eager too (0: only at admission).
        backend: "auto" (CUDA when present, else eager with no_cuda), "cuda", "sim" or a Backend.
        admission: when a key earns a capture (AdmissionConfig).
        strict: re-raise capture failures and parity mismatches instead of falling back.
        copy_outputs: return copies (True) or views of the static outputs, valid until the next
            call of this runner (False).
        stage_host_inputs: accept CPU tensors for a CUDA graph, copied through pinned buffers.
        pool_group: share one memory pool and capture stream among all graphs of this runner.
        retain: objects each graph keeps alive while it can replay (weights, KV storage).
        metrics: a GraphMetrics to report into (shared across runners), or a private one.
        clock: time source of every admission decision (tests inject a fake one).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        buckets: Buckets | None = None,
        max_bytes: int = 1 << 30,
        verify: str = "exact",
        rtol: float | None = None,
        atol: float | None = None,
        reverify_every: int = 0,
        backend: str | Backend = "auto",
        device: Any = None,
        admission: AdmissionConfig | None = None,
        strict: bool = False,
        copy_outputs: bool = True,
        stage_host_inputs: bool = False,
        pool_group: bool = False,
        retain: Sequence[Any] = (),
        metrics: GraphMetrics | None = None,
        clock: Clock = time.monotonic,
        name: str = "graph",
        enabled: bool = True,
    ):
        self.fn = fn
        self.name = name
        self.buckets = buckets
        self.verify = VerifyConfig(verify, rtol, atol, reverify_every)
        self.backend = resolve_backend(backend, device)
        self.strict = strict
        self.copy_outputs = copy_outputs
        self.stage_host_inputs = stage_host_inputs
        self.clock = clock
        self.enabled = enabled
        self.metrics = metrics if metrics is not None else GraphMetrics()
        self.policy = AdmissionPolicy(admission or AdmissionConfig(), clock)
        self._cache = GraphCache(max_bytes, on_evict=self._on_evict)
        self._group = PoolGroup(name) if pool_group else None
        self._owners = list(retain)
        self._lock = threading.RLock()
        self._closed = False
        self._stats = RunnerStats()
        self._gauge_last = (0, 0, 0)  # resident bytes, entries, host bytes last reported
        self.metrics.budget_bytes.inc(max_bytes)

    # -- the call --------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        self.metrics.calls.inc()
        reason = self._gate()
        plan: CallPlan | FallbackReason | None = None
        if reason is None and self.backend is not None:
            plan = plan_call(args, self.buckets, self.backend.device, self.stage_host_inputs)
            reason = plan if isinstance(plan, FallbackReason) else None
        if reason is None and isinstance(plan, CallPlan):
            with self._lock:
                if self._closed:
                    reason = FallbackReason.CLOSED
                else:
                    out, reason = self._serve(args, plan)
                    if reason is None:
                        return out
        assert reason is not None
        return self._fallback(args, reason)

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

    def _serve(self, args: Sequence[Any], plan: CallPlan) -> tuple[Any, FallbackReason | None]:
        self._stats.calls += 1
        self.policy.record_call(plan.key)
        with self._cache.pinned(plan.key) as entry:
            if entry is not None:
                return self._replay(entry, args, plan)
        reason = self._admission_reason(plan.key)
        if reason is not None:
            return None, reason
        return self._capture(args, plan, allow_evict=True)

    def _fallback(self, args: Sequence[Any], reason: FallbackReason) -> Any:
        self.metrics.fallbacks.labels(reason.value).inc()
        fallbacks = self._stats.fallbacks
        fallbacks[reason.value] = fallbacks.get(reason.value, 0) + 1
        return self.fn(*args)

    # -- replay ----------------------------------------------------------------------------
    def _replay(
        self, entry: GraphEntry, args: Sequence[Any], plan: CallPlan
    ) -> tuple[Any, FallbackReason | None]:
        outputs = entry.replay(lambda: copy_inputs(entry, args, plan, self.buckets))
        self._stats.replays += 1
        self.metrics.replays.inc()
        every = self.verify.reverify_every
        if every and self.verify.enabled and entry.replays % every == 0:
            eager = self.fn(*entry.static_args)
            if not outputs_match(outputs, eager, self.verify):
                self._cache.evict(entry.key, "reverify")
                self._quarantine(entry.key, "parity drift on re-verification")
                return slice_outputs(eager, plan, copy=False), None
        return slice_outputs(outputs, plan, self.copy_outputs), None

    # -- capture ---------------------------------------------------------------------------
    def _admission_reason(self, key: GraphKey) -> FallbackReason | None:
        reason = self.policy.blocked(key)
        if reason is not None:
            return reason
        hint = self.policy.size_hints.get(key)
        if hint is not None and hint > self._cache.max_bytes:
            return FallbackReason.OVER_BUDGET
        victims = self._cache.victims_for(
            hint if hint is not None else self._cache.mean_entry_bytes()
        )
        if victims is None:
            return FallbackReason.ADMISSION_DEFERRED
        if victims and not self.policy.worth_evicting(key, [v.key for v in victims]):
            return FallbackReason.ADMISSION_DEFERRED
        return None

    def _capture(
        self, args: Sequence[Any], plan: CallPlan, allow_evict: bool
    ) -> tuple[Any, FallbackReason | None]:
        key = plan.key
        hint = self.policy.size_hints.get(key)
        if hint is not None and allow_evict:
            self._cache.make_room(hint)
        started = self.clock()
        entry = GraphEntry(key, self.backend, self._group)  # type: ignore[arg-type]
        try:
            for owner in self._owners:
                entry.retain(owner)
            entry.capture(self.fn, make_static_args(entry, args, plan, self.buckets))
        except CaptureError as exc:
            return self._reject(entry, "failed", FallbackReason.CAPTURE_FAILED, exc)
        outputs = entry.replay()
        if self.verify.enabled:
            eager = self.fn(*entry.static_args)
            if not outputs_match(outputs, eager, self.verify):
                detail = describe_mismatch(outputs, eager)
                error = ParityError(
                    f"graph output differs from eager for {key.describe()}: {detail}"
                )
                return self._reject(entry, "parity_mismatch", FallbackReason.PARITY_MISMATCH, error)
            entry.verified = self.verify.mode
        seconds = self.clock() - started
        backoffs = self.policy.counters.thrash_backoffs
        self.policy.record_capture(key, seconds, entry.resident_bytes)
        self.metrics.thrash_backoffs.inc(self.policy.counters.thrash_backoffs - backoffs)
        self.metrics.capture_seconds.observe(seconds)
        fits = self._cache.victims_for(entry.resident_bytes) == [] or allow_evict
        if not (fits and self._cache.admit(entry)):
            return self._reject(entry, "over_budget", FallbackReason.OVER_BUDGET, None)
        self._stats.captures += 1
        self._stats.replays += 1  # the verified first replay serves this call
        self.metrics.replays.inc()
        self.metrics.captures.labels("admitted").inc()
        self._sync_gauges()
        log.info(
            "graphguard capture key=%s bytes=%d ms=%.1f runner=%s",
            key.describe(),
            entry.resident_bytes,
            entry.capture_ms,
            self.name,
        )
        return slice_outputs(outputs, plan, self.copy_outputs), None

    def _reject(
        self, entry: GraphEntry, outcome: str, reason: FallbackReason, error: Exception | None
    ) -> tuple[Any, FallbackReason]:
        entry.retire()
        self.backend.trim()  # type: ignore[union-attr]
        self.metrics.captures.labels(outcome).inc()
        if outcome == "over_budget":
            log.info(
                "graphguard over_budget key=%s bytes=%d budget=%d",
                entry.key.describe(),
                entry.resident_bytes,
                self._cache.max_bytes,
            )
        else:
            self._stats.capture_failures += outcome == "failed"
            self._stats.parity_mismatches += outcome == "parity_mismatch"
            self._quarantine(entry.key, f"{outcome}: {error}")
            if self.strict and error is not None:
                raise error
        return None, reason

    def _quarantine(self, key: GraphKey, why: str) -> None:
        delay = self.policy.quarantine(key)
        self.metrics.quarantined.set(self.policy.num_quarantined())
        log.warning(
            "graphguard quarantine key=%s backoff_s=%.1f why=%s", key.describe(), delay, why
        )

    def _on_evict(self, entry: GraphEntry, cause: str) -> None:
        self._stats.evictions += 1
        self.metrics.evictions.labels(cause).inc()
        if cause == "budget":
            self.policy.record_eviction(entry.key)
        self._sync_gauges()

    # -- set-up paths ----------------------------------------------------------------------
    def warmup(self, examples: Iterable[Sequence[Any]], progress: bool = True) -> WarmupReport:
        """Capture the keys of `examples` up front, largest first, within the budget."""
        report, started = WarmupReport(), time.perf_counter()
        plans = []
        for args in examples:
            plan = (
                plan_call(args, self.buckets, self.backend.device, self.stage_host_inputs)
                if self.backend is not None
                else FallbackReason.NO_CUDA
            )
            if isinstance(plan, FallbackReason):
                report.skipped[repr(args)[:80]] = plan.value
            else:
                plans.append((plan, args))
        plans.sort(key=lambda p: p[0].key.input_bytes, reverse=True)
        bar = tqdm(plans, desc=f"graphguard warmup {self.name}", disable=not progress)
        with self._lock:
            for plan, args in bar:
                self._warm_one(plan, args, report)
        report.seconds = time.perf_counter() - started
        log.info(
            "graphguard warmup runner=%s captured=%d skipped=%d seconds=%.2f",
            self.name,
            len(report.captured),
            len(report.skipped),
            report.seconds,
        )
        return report

    def _warm_one(self, plan: CallPlan, args: Sequence[Any], report: WarmupReport) -> None:
        name = plan.key.describe()
        if plan.key in self._cache:
            self.policy.prewarmed.add(plan.key)
            report.captured.append(name)
            return
        reason = self._gate() or self.policy.blocked_for_warmup(plan.key)
        if reason is None:
            _, reason = self._capture(args, plan, allow_evict=False)
        if reason is None:
            self.policy.prewarmed.add(plan.key)
            report.captured.append(name)
        else:
            report.skipped[name] = reason.value

    # -- lifecycle and introspection -------------------------------------------------------
    def invalidate(self, cause: str = "invalidate") -> int:
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
            self.invalidate("close")
            self._closed = True
            self.metrics.budget_bytes.dec(self._cache.max_bytes)

    def entries(self) -> list[EntryInfo]:
        return [entry.info() for entry in self._cache.entries()]

    def admitted_keys(self) -> list[GraphKey]:
        return [entry.key for entry in self._cache.entries()]

    def stats(self) -> dict[str, Any]:
        """A snapshot: counts, bytes, fallbacks by reason, admission counters."""
        with self._lock:
            entries = self._cache.entries()
            stats = asdict(self._stats)
            served = self._stats.calls or 1
            stats.update(
                name=self.name,
                backend=self.backend.name if self.backend is not None else None,
                closed=self._closed,
                resident_bytes=self._cache.resident_bytes,
                max_bytes=self._cache.max_bytes,
                host_bytes=sum(e.host_bytes for e in entries),
                entries=len(entries),
                quarantined_keys=self.policy.num_quarantined(),
                hit_rate=round(self._stats.replays / served, 4),
                admission=asdict(self.policy.counters),
            )
            return stats

    def _sync_gauges(self) -> None:
        # NOTE: gauges may be shared by several runners, so they move by this runner's delta.
        resident = self._cache.resident_bytes
        count = len(self._cache)
        host = sum(e.host_bytes for e in self._cache.entries())
        last = self._gauge_last
        self.metrics.resident_bytes.inc(resident - last[0])
        self.metrics.entries.inc(count - last[1])
        self.metrics.host_bytes.inc(host - last[2])
        self._gauge_last = (resident, count, host)
