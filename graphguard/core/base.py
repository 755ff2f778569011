"""What every runner of graphs shares: the flow of a call, the gate, admission, the byte-budget
cache, the bookkeeping of captures, rejections and evictions, and the lifecycle.

GraphRunner keys single graphs; SegmentedRunner keys groups of segment graphs. RunnerBase owns
the one flow of a call (gate, plan, then under the lock replay or capture, else exactly one
FallbackReason), so one set of rules (deny by default, the admission policy, quarantine,
metrics) serves both. A runner implements the flow's hooks: planning a call into a key,
replaying an admitted entry, capturing and verifying a candidate in bounded units of work,
answering a call eagerly, and (for captures between calls) example inputs of a key.

A capture runs in the call that earned it, or, with `background=True`, between calls: the
call answers eagerly (`capture_in_progress`) and `advance_capture()` runs the capture one unit
at a time (graphguard.core.background).

Lock order: an engine's lifecycle lock, then the runner's lock, then its cache's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from graphguard.core.admission import AdmissionConfig, AdmissionPolicy, Clock
from graphguard.core.backends import Backend
from graphguard.core.cache import GraphCache
from graphguard.core.capture_flow import C, CaptureFlow, CaptureMode, E
from graphguard.core.decisions import (
    Action,
    Agreement,
    Decision,
    Orders,
    RankDivergence,
    SoloAgreement,
)
from graphguard.core.following import Following
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics, RunnerCounts
from graphguard.core.reasons import EvictionCause, FallbackReason
from graphguard.core.switch import kill_switch_on, resolve_backend
from graphguard.core.verify import VerifyConfig

log = logging.getLogger("graphguard")

# Why a call of a key without a graph may be answered by a larger admitted bucket (`_cover`):
# the key is only waiting for its capture. Not a quarantined key, nor one over the budget or
# thrashing, which answer eagerly as their reason says.
COVERABLE = (FallbackReason.ADMISSION_DEFERRED, FallbackReason.CAPTURE_IN_PROGRESS)


@dataclass
class WarmupReport:
    captured: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # key -> reason
    seconds: float = 0.0


class RunnerBase(CaptureFlow[E, C], Following[E, C]):
    """Shared state, flow and rules of graph runners (see module docstring)."""

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
        background: bool = False,
        agreement: Agreement | None = None,
        orders: Orders | None = None,
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
        self.background = background  # capture between calls (advance_capture), not in them
        self.agreement = agreement if agreement is not None else SoloAgreement()
        self.orders = orders  # None: this runner decides; else a leader's or follower's orders
        self.metrics = metrics if metrics is not None else GraphMetrics()
        self.policy = AdmissionPolicy(admission or AdmissionConfig(), clock)
        self._cache: GraphCache[E] = GraphCache(max_bytes, on_evict=self._on_evict)
        self._owners = list(retain)
        self._lock = threading.RLock()
        self._closed = False
        self._counts = RunnerCounts(self.metrics)
        self._job = None
        self._num_units = 0
        self._max_unit_s = 0.0
        self.metrics.budget_bytes.inc(max_bytes)

    # -- the flow of a call ----------------------------------------------------------------
    def _run(self, call: C) -> Any:
        """Replay the graph `call` maps to, or answer it eagerly with exactly one reason."""
        if self.orders is not None:  # a tensor-parallel rank (graphguard.core.decisions)
            return self.orders.on_call(self, call)
        reason, key = self._gate(), None  # key: the call's, once planned
        if reason is None:
            plan = self._plan(call)
            if isinstance(plan, FallbackReason):
                reason = plan
            else:
                key = plan.key
                with self._lock:
                    if self._closed:
                        reason = FallbackReason.CLOSED
                    else:
                        out, reason = self._act(call, plan, self._choose(key))
                        if reason is None:
                            return out
                        if out is not None:  # an eager run already answered this call
                            return self._fallback(call, reason, out)
        return self._fallback(call, reason, None, key)  # NOTE: eager work runs unlocked

    def _fallback(
        self, call: C, reason: FallbackReason, out: Any, key: GraphKey | None = None
    ) -> Any:
        """Count the call's one reason; answer it eagerly unless `out` already does. An eager
        call of `key` is timed for the admission's payback rule."""
        self._counts.fallback(reason)
        if out is not None:
            return out
        if key is None or not self.policy.config.payback:
            return self._eager(call)
        started = self.clock()
        out = self._eager(call)
        seconds = self.clock() - started
        with self._lock:
            self.policy.record_eager(key, seconds)
        return out

    def _choose(self, key: GraphKey) -> Decision:
        """What to do with a call of `key` (under the lock): the leader's half of a call."""
        self.policy.record_call(key)
        if key in self._cache:
            return Decision(Action.REPLAY, key)
        decision = self._choose_missing(key)
        if decision.action is Action.START_CAPTURE or decision.reason in COVERABLE:
            cover = self._cover(key)
            if cover is not None:  # a larger admitted bucket answers instead of eager
                action = Action.REPLAY if decision.action is Action.FALLBACK else decision.action
                return Decision(action, key, cover=cover)
        return decision

    def _choose_missing(self, key: GraphKey) -> Decision:
        """`_choose` for a key that has no graph: capture it, start capturing it, or why not."""
        job = self._job
        if job is not None and job.key == key:
            return Decision.fallback(FallbackReason.CAPTURE_IN_PROGRESS)
        reason = self._admission_reason(key)
        if reason is not None:
            return Decision.fallback(reason)
        if not self.background:
            return Decision(Action.CAPTURE, key)
        if job is not None:  # one capture between calls at a time
            self.policy.counters.deferred += 1
            return Decision.fallback(FallbackReason.ADMISSION_DEFERRED)
        return Decision(Action.START_CAPTURE, key)

    def _cover(self, key: GraphKey) -> GraphKey | None:
        """An admitted key that may answer a call of `key`, which has no graph, instead of
        eager (GraphRunner: a larger bucket within `max_pad_factor`); None: none may."""
        del key
        return None

    def _act(
        self, call: C, plan: CallPlan, decision: Decision
    ) -> tuple[Any, FallbackReason | None]:
        """Carry out a decision on `call` (under the lock): replay, capture or start one."""
        key = plan.key
        if decision.action is Action.FALLBACK:
            return None, decision.reason
        if decision.action is Action.CAPTURE:
            return self._capture(call, plan, CaptureMode.ON_CALL)
        if decision.action is Action.START_CAPTURE:
            self._job = self._new_job(key, lambda: self._example(key), CaptureMode.BACKGROUND)
            self._sync_gauges()
            if decision.cover is None:
                return None, FallbackReason.CAPTURE_IN_PROGRESS
        if decision.cover is not None:
            # NOTE: the call's real rows are copied into the larger graph's static inputs and
            # the rest padded, as for the call's own bucket (copy_inputs)
            plan = CallPlan(decision.cover, plan.rows)
        entry = self._cache.acquire(plan.key)
        if entry is None:  # NOTE: only a follower can get here: a leader decided under lock
            raise RankDivergence(f"{self.name}: {plan.key.describe()} is not admitted here")
        if decision.cover is not None:
            self._counts.cover()
        started = self.clock()
        try:
            return self._replay(entry, call, plan)
        finally:
            self._cache.release(entry)
            self.policy.record_replay(self.clock() - started)

    # -- hooks of the flow -----------------------------------------------------------------
    @abstractmethod
    def _plan(self, call: C) -> CallPlan | FallbackReason:
        """The key `call` maps to (with its real rows), or why it cannot replay."""

    @abstractmethod
    def _replay(self, entry: E, call: C, plan: CallPlan) -> tuple[Any, FallbackReason | None]:
        """Replay a pinned admitted entry: (answer, None), or (an answer or None, reason) when
        the call counts as a fallback. Counts its replays (self._counts.replay())."""

    @abstractmethod
    def _eager(self, call: C) -> Any:
        """The call's answer without graphs."""

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

    # -- bookkeeping -----------------------------------------------------------------------
    def _on_evict(self, entry: E, cause: EvictionCause) -> None:
        self._counts.eviction(cause)
        if cause is EvictionCause.BUDGET:
            self.policy.record_eviction(entry.key)
        if cause in (EvictionCause.BUDGET, EvictionCause.REVERIFY) and self.backend is not None:
            # NOTE: the evicted pool is released; trimming hands its reserved bytes back now,
            # so the device really holds no more than the budget says.
            self.backend.trim()
        self._sync_gauges()

    def _sync_gauges(self) -> None:
        cache, policy = self._cache, self.policy
        graphs, host_bytes = self._num_graphs(), self._host_bytes()
        self._counts.move_gauges(
            cache.resident_bytes, graphs, host_bytes, policy.num_quarantined(), cache.reserved_bytes
        )

    # -- set-up --------------------------------------------------------------------------
    def warm_keys(self, keys: Iterable[GraphKey], progress: bool = True) -> WarmupReport:
        """Capture `keys` up front on their example inputs (`_example`, as a capture between
        calls runs on), largest first, within the budget: each one taken is prewarmed."""
        report, started = WarmupReport(), time.perf_counter()
        plans = [(plan, call) for call, plan in map(self._example, keys)]
        return self._warm_plans(plans, report, started, progress)

    def _warm_plans(
        self,
        plans: list[tuple[CallPlan, C]],
        report: WarmupReport,
        started: float,
        progress: bool,
    ) -> WarmupReport:
        """Warm-up captures of planned calls, largest key first, with a progress bar; the
        report, its time counted from `started`."""
        plans.sort(key=lambda p: p[0].key.input_bytes, reverse=True)
        bar = tqdm(plans, desc=f"graphguard warmup {self.name}", disable=not progress)
        with self._lock:
            for plan, call in bar:
                self._warm_one(plan, call, report)
        report.seconds = time.perf_counter() - started
        log.info(
            "graphguard warmup runner=%s captured=%d skipped=%d seconds=%.2f",
            self.name,
            len(report.captured),
            len(report.skipped),
            report.seconds,
        )
        return report

    def _warm_one(self, plan: CallPlan, call: C, report: WarmupReport) -> None:
        """Capture one key at warm-up (no eviction, answers no call), unless it is resident
        or backed off; either way a key taken is prewarmed."""
        name = plan.key.describe()
        if plan.key in self._cache:
            self.policy.prewarmed.add(plan.key)
            report.captured.append(name)
            return
        reason = self._gate() or self.policy.blocked_for_warmup(plan.key)
        if reason is None:
            _, reason = self._capture(call, plan, CaptureMode.WARMUP)
        if reason is None:
            self.policy.prewarmed.add(plan.key)
            report.captured.append(name)
        else:
            report.skipped[name] = reason.value

    # -- lifecycle and introspection -------------------------------------------------------
    def invalidate(self, cause: EvictionCause | str = EvictionCause.INVALIDATE) -> int:
        """Retire every graph (weights reloaded, say), and cancel the capture in flight.
        Returns how many admitted graphs were retired."""
        with self._lock:
            self._cancel_job()  # it ran on the old state: its graph must never be admitted
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

    @property
    def max_bytes(self) -> int:
        """The resident byte budget of this runner's graphs."""
        return self._cache.max_bytes

    @contextmanager
    def resident(self) -> Iterator[list[E]]:
        """The admitted entries, least recently used first, pinned until the block ends.

        They are pinned under this runner's lock (between calls), which is let go before the
        block runs: calls replay meanwhile and eviction skips the pinned entries. Invalidate
        and close still retire them, each under the entry's own lock, which a reader of an
        entry takes too (export does). Nothing here resets or re-captures a graph.
        """
        with self._lock:
            entries = self._cache.acquire_all()
        try:
            yield entries
        finally:
            self._cache.release_all(entries)

    def _num_graphs(self) -> int:
        return len(self._cache)

    def _host_bytes(self) -> int:
        return sum(entry.host_bytes for entry in self._cache.entries())

    def _base_stats(self) -> dict[str, Any]:
        self._sync_gauges()  # quarantines expire with time, not with an event
        stats = self._counts.snapshot()
        price = self.policy.mean_price
        stats.update(
            name=self.name,
            backend=self.backend.name if self.backend is not None else None,
            closed=self._closed,
            resident_bytes=self._cache.resident_bytes,
            max_bytes=self._cache.max_bytes,
            reserved_bytes=self._cache.reserved_bytes,
            capture_in_flight=job.key.describe() if (job := self._job) is not None else None,
            background_units=self._num_units,
            background_unit_max_ms=round(self._max_unit_s * 1e3, 3),
            host_bytes=self._host_bytes(),
            quarantined_keys=self.policy.num_quarantined(),
            hit_rate=round(stats["replays"] / (stats["calls"] or 1), 4),
            admission=asdict(self.policy.counters),
            # what an admitted capture cost in work, on average (the payback rule's price)
            capture_price_ms=round(price * 1e3, 3) if price is not None else None,
        )
        return stats
