"""Runner: a call replays an admitted graph, or runs eagerly with exactly one reason, or earns a
capture. This file is the whole flow, top to bottom:

1. `run(call)`: the gate (kill switch, disabled, no CUDA, closed), then the kind plans the call
   into a key; then, under the runner's lock, `_choose` decides (replay, capture now, start a
   capture between calls, or fall back with one reason: the admission policy's, the budget's,
   quarantine's) and `_act` carries the decision out. Eager work runs outside the lock.
2. A capture is a CaptureJob (graphguard.core.capture): the candidate, the bytes it reserves and
   the kind's units of work. It runs at once (`_capture_now`: in the call that earned it, or at
   warm-up), or one unit per `advance_capture()` between calls, while the key's calls answer
   eagerly with `capture_in_progress`. Its Verdict is settled here (`_settle`): admitted into
   the byte-budget cache, or rejected (retired, counted, quarantined on a failure).
3. Bookkeeping: evictions, gauges, warm-up, lifecycle, stats.

What differs between single graphs and groups of segment graphs is the kind's
(graphguard.core.kind); this file decides and counts for both. `decide` / `follow` are the two
halves of `run` apart, for a runner whose decisions drive others (graphguard.engine.parallel).

Lock order: an engine's lifecycle lock, then the runner's lock, then its cache's lock.
NOTE: this file is over 300 lines on purpose: the flow of a call reads in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any, Generic

from tqdm.auto import tqdm

from graphguard.core.admission import AdmissionConfig, AdmissionPolicy
from graphguard.core.backends import Backend
from graphguard.core.cache import GraphCache
from graphguard.core.capture import (
    C,
    CaptureJob,
    CaptureMode,
    CaptureUnits,
    E,
    Reservation,
    WarmupReport,
)
from graphguard.core.decisions import Action, Decision, DecisionError
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.kind import GraphKind
from graphguard.core.metrics import GraphMetrics, RunnerCounts
from graphguard.core.options import CaptureConfig
from graphguard.core.reasons import CaptureOutcome, EvictionCause, FallbackReason
from graphguard.core.switch import kill_switch_on

log = logging.getLogger("graphguard")

Clock = Callable[[], float]
Outcome = tuple[Any, FallbackReason | None]  # (an answer or None, the reason it fell back)

# Why a call of a key without a graph may be answered by a larger admitted bucket: the key is
# only waiting for its capture (not quarantined, over the budget or thrashing).
COVERABLE = (FallbackReason.ADMISSION_DEFERRED, FallbackReason.CAPTURE_IN_PROGRESS)
# The reason a call falls back with when its capture is rejected with each outcome.
REJECTED = {
    CaptureOutcome.FAILED: FallbackReason.CAPTURE_FAILED,
    CaptureOutcome.PARITY_MISMATCH: FallbackReason.PARITY_MISMATCH,
    CaptureOutcome.OVER_BUDGET: FallbackReason.OVER_BUDGET,
}


class Runner(Generic[E, C]):
    """The flow and rules of a graph runner over one kind of graphs (see module docstring)."""

    def __init__(
        self,
        kind: GraphKind[E, C],
        *,
        backend: Backend | None,
        max_bytes: int,
        admission: AdmissionConfig | None,
        capture: CaptureConfig,
        metrics: GraphMetrics | None,
        clock: Clock,
        name: str,
    ):
        self.kind = kind
        self.backend = backend  # None: no CUDA, every call falls back
        self.options = capture
        self.clock = clock
        self.name = name
        self.metrics = metrics if metrics is not None else GraphMetrics()
        self.policy = AdmissionPolicy(admission or AdmissionConfig(), clock)
        self._cache: GraphCache[E] = GraphCache(max_bytes, on_evict=self._on_evict)
        self._job: CaptureJob[E, C] | None = None  # the capture between calls, if any
        self._lock = threading.RLock()
        self._closed = False
        self._counts = RunnerCounts(self.metrics)
        self._num_units = 0  # units of captures between calls run so far
        self._max_unit_s = 0.0  # the longest of them
        self.metrics.budget_bytes.inc(max_bytes)

    # -- 1. a call ----------------------------------------------------------------------------
    def run(self, call: C) -> Any:
        """Replay the graph `call` maps to, or answer it eagerly with exactly one reason."""
        reason = self._gate()
        plan = self.kind.plan(call) if reason is None else reason
        if isinstance(plan, FallbackReason):
            return self._fallback(call, plan)
        with self._lock:
            out, reason = None, FallbackReason.CLOSED
            if not self._closed:
                self.policy.record_call(plan.key)
                entry = self._cache.acquire(plan.key)  # pinned: the common case, a replay
                if entry is not None:
                    out, reason = self._replay(entry, call, plan)
                else:
                    out, reason = self._act(call, plan, self._choose_without_graph(plan.key))
                if reason is None:
                    return out
        return self._fallback(call, reason, out, plan.key)  # NOTE: eager work runs unlocked

    def _gate(self) -> FallbackReason | None:
        """Why no graph may run now, if so."""
        if kill_switch_on():
            return FallbackReason.KILL_SWITCH
        if not self.options.enabled:
            return FallbackReason.DISABLED
        if self.backend is None:
            return FallbackReason.NO_CUDA
        if self._closed:
            return FallbackReason.CLOSED
        return None

    def _choose(self, key: GraphKey) -> Decision:
        """What to do with a call of `key` (under the lock); `run` makes the same choice."""
        self.policy.record_call(key)
        if key in self._cache:
            return Decision(Action.REPLAY, key)
        return self._choose_without_graph(key)

    def _choose_without_graph(self, key: GraphKey) -> Decision:
        """`_choose` for a key that has no graph: a larger admitted bucket may answer it
        while it waits for its own capture (the kind's `cover`)."""
        decision = self._choose_missing(key)
        if decision.action is Action.START_CAPTURE or decision.reason in COVERABLE:
            cover = self.kind.cover(key, self._cache.__contains__)
            if cover is not None:  # a larger admitted bucket answers instead of eager
                action = Action.REPLAY if decision.action is Action.FALLBACK else decision.action
                return Decision(action, key, cover=cover)
        return decision

    def _choose_missing(self, key: GraphKey) -> Decision:
        """`_choose` for a key without a graph: capture it, start capturing it, or why not."""
        job = self._job
        if job is not None and job.key == key:
            return Decision.fallback(FallbackReason.CAPTURE_IN_PROGRESS)
        reason = self._admission_reason(key)
        if reason is not None:
            return Decision.fallback(reason)
        if not self.options.background:
            return Decision(Action.CAPTURE, key)
        if job is not None:  # one capture between calls at a time
            self.policy.counters.deferred += 1
            return Decision.fallback(FallbackReason.ADMISSION_DEFERRED)
        return Decision(Action.START_CAPTURE, key)

    def _admission_reason(self, key: GraphKey) -> FallbackReason | None:
        """Why `key` may not be captured now: the policy's rules, then the budget's."""
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

    def _act(self, call: C, plan: CallPlan, decision: Decision) -> Outcome:
        """Carry out a decision on `call` (under the lock): replay, capture or start one."""
        if decision.action is Action.FALLBACK:
            return None, decision.reason
        if decision.action is Action.CAPTURE:
            return self._capture_now(call, plan, CaptureMode.ON_CALL)
        if decision.action is Action.START_CAPTURE:
            key = plan.key
            self._job = self._new_job(key, lambda: self.kind.example(key), CaptureMode.BACKGROUND)
            self._sync_gauges()
            if decision.cover is None:
                return None, FallbackReason.CAPTURE_IN_PROGRESS
        if decision.cover is not None:
            # NOTE: the call's real rows are copied into the larger graph's static inputs and
            # the rest padded, as for the call's own bucket
            plan = CallPlan(decision.cover, plan.rows)
            self._counts.cover()
        entry = self._cache.acquire(plan.key)
        if entry is None:  # NOTE: only a follower gets here: a decider decided under the lock
            raise DecisionError(f"{self.name}: {plan.key.describe()} is not admitted here")
        return self._replay(entry, call, plan)

    def _replay(self, entry: E, call: C, plan: CallPlan) -> Outcome:
        """Replay a pinned entry for `call`, then unpin it; a drift found by re-verification
        retires the entry and quarantines its key."""
        started = self.clock()
        try:
            replayed = self.kind.replay(entry, call, plan)
        except Exception as exc:
            # NOTE: the step may be partly run (graphs before a failed hole): no eager answer
            # could be trusted, so the error goes to the caller, and the graph goes
            self._cache.release(entry)
            self._cache.evict(entry.key, EvictionCause.REPLAY_FAILED)
            self._quarantine(entry.key, f"replay failed: {type(exc).__name__}: {exc}")
            raise
        else:
            self._cache.release(entry)
        finally:
            self.policy.record_replay(self.clock() - started)
        if replayed.drift is not None:
            self._cache.evict(entry.key, EvictionCause.REVERIFY)
            self._counts.drift()
            self._quarantine(entry.key, f"drift on re-verification: {replayed.drift}")
        elif replayed.reason is None:
            self._counts.replay()
        return replayed.answer, replayed.reason

    def _fallback(
        self, call: C, reason: FallbackReason, out: Any = None, key: GraphKey | None = None
    ) -> Any:
        """Count the call's one reason; answer it eagerly unless `out` already does. An eager
        call of `key` is timed for the admission's payback rule."""
        self._counts.fallback(reason)
        if out is not None:
            return out
        if key is None or not self.policy.config.payback:
            return self.kind.eager(call)
        started = self.clock()
        out = self.kind.eager(call)
        seconds = self.clock() - started
        with self._lock:
            self.policy.record_eager(key, seconds)
        return out

    # -- 2. a capture -------------------------------------------------------------------------
    def _capture_now(self, call: C, plan: CallPlan, mode: CaptureMode) -> Outcome:
        """Capture `plan.key` on `call`, every unit at once (ON_CALL or WARMUP)."""
        job = self._new_job(plan.key, lambda: (call, plan), mode)
        job.run()
        return self._settle(job)

    def _new_job(
        self, key: GraphKey, inputs: Callable[[], tuple[C, CallPlan]], mode: CaptureMode
    ) -> CaptureJob[E, C]:
        reservation = None
        if mode is not CaptureMode.WARMUP:
            # NOTE: the capture in flight reserves its expected bytes: eviction comes first, so
            # the device never holds more than the budget while the candidate captures.
            reservation = Reservation(self._cache)
            reservation.cover(self._expected_bytes(key))
        candidate = self.kind.new_candidate(key)
        return CaptureJob(
            candidate, mode, inputs, self._capture_units, reservation, self.clock,
            self.policy.record_work,
        )  # fmt: skip

    def _capture_units(self, candidate: E, call: C, plan: CallPlan) -> CaptureUnits:
        """The kind's units of capture work (a rank's runner adds its agreement here)."""
        return self.kind.capture(candidate, call, plan)

    def _settle(self, job: CaptureJob[E, C]) -> Outcome:
        """Admit an ended capture's candidate, or reject it as its Verdict says.

        NOTE: the step's state (the Verdict's `state`) keeps the first replay's writes only when
        that replay answers the call: a rejected capture, or one that answers no call, puts it
        back, so the caller observes exactly one execution of the step."""
        verdict, candidate = job.verdict, job.candidate
        assert verdict is not None and job.plan is not None
        answers = verdict.outcome is None and job.mode is CaptureMode.ON_CALL
        if verdict.state is not None and not answers:
            verdict.state.undo()
        if verdict.outcome is CaptureOutcome.OVER_BUDGET:
            self.policy.size_hints[job.key] = candidate.resident_bytes
        if verdict.refusal is not None:
            self.policy.refusals[job.key] = verdict.refusal
        if verdict.outcome is not None:
            reason = self._reject(candidate, verdict.outcome, verdict.error)
            return verdict.eager, verdict.refusal or reason
        self._count_capture(job.key, candidate.resident_bytes)
        # NOTE: a warm-up capture never evicts: it must not displace graphs that calls earned.
        fits = (
            job.mode is not CaptureMode.WARMUP
            or self._cache.victims_for(candidate.resident_bytes) == []
        )
        if not (fits and self._cache.admit(candidate)):
            if verdict.state is not None:
                verdict.state.undo()
            return verdict.eager, self._reject(candidate, CaptureOutcome.OVER_BUDGET, None)
        self._counts.capture(CaptureOutcome.ADMITTED)
        if job.mode is CaptureMode.ON_CALL:
            self._counts.replay()  # the verified first replay answers this call
        self._sync_gauges()
        self.metrics.capture_seconds.observe(job.seconds)
        self.policy.record_price(job.key, job.seconds)
        return self.kind.admitted(candidate, verdict.outputs, job.plan, job.mode), None

    def _reject(self, candidate: E, outcome: CaptureOutcome, error: Any) -> FallbackReason:
        """Retire a candidate that failed capture, parity, the budget or its state's check;
        quarantine failures. Returns the reason its call falls back with."""
        candidate.retire()
        if self.backend is not None:
            self.backend.trim()
        self._counts.capture(outcome)
        key = candidate.key.describe()
        if outcome is CaptureOutcome.OVER_BUDGET:
            log.info(
                "graphguard over_budget key=%s bytes=%d budget=%d runner=%s",
                key, candidate.resident_bytes, self._cache.max_bytes, self.name,
            )  # fmt: skip
        elif outcome is CaptureOutcome.STATE_REFUSED:
            log.warning("graphguard state refused key=%s why=%s runner=%s", key, error, self.name)
            self._sync_gauges()
        else:
            self._quarantine(candidate.key, f"{outcome}: {error}")
            if self.options.strict and isinstance(error, Exception):
                raise error
        return REJECTED.get(outcome, FallbackReason.CAPTURE_FAILED)

    def _quarantine(self, key: GraphKey, why: str) -> None:
        delay = self.policy.quarantine(key)
        self._sync_gauges()
        log.warning(
            "graphguard quarantine key=%s backoff_s=%.1f why=%s", key.describe(), delay, why
        )

    def advance_capture(self) -> bool:
        """Run the next unit of the capture in flight between calls, if any. Call it between
        calls (the engine: once per step, on its step thread). Returns True while a capture
        remains in flight. The kill switch, a disabled or a closed runner cancel it."""
        with self._lock:
            return self._advance(self._advance_decision())

    def _advance_decision(self) -> Decision:
        """What to do between calls (under the lock)."""
        job = self._job
        if job is None:
            return Decision(Action.IDLE)
        if self._gate() is not None:
            return Decision(Action.CANCEL, job.key)
        return Decision(Action.ADVANCE, job.key)

    def _advance(self, decision: Decision) -> bool:
        """Carry out a decision between calls (under the lock); True while a capture remains."""
        job = self._job
        if job is None or decision.action is Action.IDLE:
            if job is not None or decision.action is not Action.IDLE:
                raise DecisionError(
                    f"{self.name}: the capture in flight differs from the decider's"
                )
            return False
        if job.key != decision.key:
            raise DecisionError(f"{self.name}: capturing {job.key.describe()}, not the decider's")
        if decision.action is Action.CANCEL:
            self._cancel_job()
            return False
        try:
            is_done = job.advance()
        except Exception as exc:
            self._job = None  # the job's cleanup retired the candidate
            self._reject(job.candidate, CaptureOutcome.FAILED, exc)
            return False
        finally:
            self._num_units += 1
            self._max_unit_s = max(self._max_unit_s, job.max_unit_s)
            self._sync_gauges()
        if is_done:
            self._job = None
            self._settle(job)
        return self._job is not None

    @property
    def capture_in_flight(self) -> GraphKey | None:
        """The key being captured between calls, if any."""
        job = self._job
        return job.key if job is not None else None

    def _cancel_job(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        job.cancel()
        self._counts.capture(CaptureOutcome.CANCELLED)
        if self.backend is not None:
            self.backend.trim()
        self._sync_gauges()
        log.info(
            "graphguard capture cancelled key=%s units=%d ms=%.1f runner=%s",
            job.key.describe(), job.num_units, job.seconds * 1e3, self.name,
        )  # fmt: skip

    # -- the two halves of a call, apart ------------------------------------------------------
    def decide(self, call: C) -> Decision:
        """The decision `run` would make for `call`; every runner it drives then carries it out
        with follow() (the key travels with a fallback too: each times its eager call)."""
        reason = self._gate()
        plan = self.kind.plan(call) if reason is None else reason
        if isinstance(plan, FallbackReason):
            return Decision.fallback(plan)
        with self._lock:
            if self._closed:
                return Decision.fallback(FallbackReason.CLOSED)
            resident = tuple(entry.key for entry in self._cache.entries())
            return replace(self._choose(plan.key), key=plan.key, resident=resident)

    def follow(self, call: C, decision: Decision) -> Any:
        """Carry out a decision made by `decide` (here or in another runner); never decides."""
        if decision.action is Action.FALLBACK:
            assert decision.reason is not None
            return self._fallback(call, decision.reason, None, decision.key)
        plan = self.kind.plan(call)
        if isinstance(plan, FallbackReason) or plan.key != decision.key:
            raise DecisionError(
                f"{self.name}: this runner plans {plan}, the decider {decision.key}"
            )
        with self._lock:
            for entry in self._cache.entries():
                if entry.key not in decision.resident:  # the decider evicted it
                    self._cache.evict(entry.key, EvictionCause.BUDGET)
            out, reason = self._act(call, plan, decision)
        return out if reason is None else self._fallback(call, reason, out)

    def decide_between_calls(self) -> Decision:
        """The decision between calls: advance, cancel or nothing (follow_between_calls)."""
        with self._lock:
            return self._advance_decision()

    def follow_between_calls(self, decision: Decision) -> bool:
        """Carry out a decision between calls; True while a capture remains."""
        with self._lock:
            return self._advance(decision)

    # -- 3. bookkeeping -----------------------------------------------------------------------
    def _expected_bytes(self, key: GraphKey) -> int:
        """What a capture of `key` is expected to hold: its last size, else the mean entry's."""
        hint = self.policy.size_hints.get(key)
        return hint if hint is not None else self._cache.mean_entry_bytes()

    def _count_capture(self, key: GraphKey, resident_bytes: int) -> None:
        """A verified capture about to be admitted: admission history and thrash metrics."""
        backoffs = self.policy.counters.thrash_backoffs
        self.policy.record_admitted(key, resident_bytes)
        self.metrics.thrash_backoffs.inc(self.policy.counters.thrash_backoffs - backoffs)

    def _on_evict(self, entry: E, cause: EvictionCause) -> None:
        self._counts.eviction(cause)
        if cause is EvictionCause.BUDGET:
            self.policy.record_eviction(entry.key)
        one_by_one = (EvictionCause.BUDGET, EvictionCause.REVERIFY, EvictionCause.REPLAY_FAILED)
        if cause in one_by_one and self.backend is not None:
            # NOTE: the evicted pool is released; trimming hands its reserved bytes back now,
            # so the device really holds no more than the budget says.
            self.backend.trim()
        self._sync_gauges()

    def _sync_gauges(self) -> None:
        cache, policy = self._cache, self.policy
        self._counts.move_gauges(
            cache.resident_bytes, self._num_graphs(), self._host_bytes(),
            policy.num_quarantined(), cache.reserved_bytes,
        )  # fmt: skip

    def _num_graphs(self) -> int:
        return sum(self.kind.num_graphs(entry) for entry in self._cache.entries())

    def _host_bytes(self) -> int:
        return sum(entry.host_bytes for entry in self._cache.entries())

    def warm_keys(self, keys: Iterable[GraphKey], progress: bool = True) -> WarmupReport:
        """Capture `keys` up front on their example inputs (as a capture between calls runs
        on), largest first, within the budget: each one taken is prewarmed."""
        started = time.perf_counter()
        return self._warm([(p, c) for c, p in map(self.kind.example, keys)], started, progress)

    def _warm(
        self, plans: list[tuple[CallPlan, C]], started: float, progress: bool
    ) -> WarmupReport:
        """Warm-up captures of planned calls, largest key first, with a progress bar: each
        takes free room only and answers no call; a key taken is prewarmed."""
        report = WarmupReport()
        plans.sort(key=lambda p: p[0].key.input_bytes, reverse=True)
        with self._lock:
            for plan, call in tqdm(
                plans, desc=f"graphguard warmup {self.name}", disable=not progress
            ):
                name = plan.key.describe()
                reason = None if plan.key in self._cache else self._warm_one(plan, call)
                if reason is None:
                    self.policy.prewarmed.add(plan.key)
                    report.captured.append(name)
                else:
                    report.skipped[name] = reason.value
        report.seconds = time.perf_counter() - started
        log.info(
            "graphguard warmup runner=%s captured=%d skipped=%d seconds=%.2f",
            self.name, len(report.captured), len(report.skipped), report.seconds,
        )  # fmt: skip
        return report

    def _warm_one(self, plan: CallPlan, call: C) -> FallbackReason | None:
        reason = self._gate() or self.policy.blocked_for_warmup(plan.key)
        return (
            reason if reason is not None else self._capture_now(call, plan, CaptureMode.WARMUP)[1]
        )

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

    def stats(self) -> dict[str, Any]:
        """A snapshot: counts, bytes, fallbacks by reason, admission counters."""
        with self._lock:
            self._sync_gauges()  # quarantines expire with time, not with an event
            stats, price, job = self._counts.snapshot(), self.policy.mean_price, self._job
            stats.update(
                name=self.name,
                backend=self.backend.name if self.backend is not None else None,
                closed=self._closed,
                resident_bytes=self._cache.resident_bytes,
                max_bytes=self._cache.max_bytes,
                reserved_bytes=self._cache.reserved_bytes,
                capture_in_flight=job.key.describe() if job is not None else None,
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
