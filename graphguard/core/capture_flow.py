"""How a runner captures a key's graph, checks it against eager and admits it.

CaptureFlow is the half of RunnerBase (graphguard/core/base.py) that captures: a capture is a
generator of bounded units of work (graphguard.core.background) that either runs at once, in
the call that earned the key or at warm-up, or between calls (`advance_capture()`), one unit
each time, on example inputs, while the key's calls run eagerly with `capture_in_progress`.
Either way the same code reserves the candidate's bytes, captures, checks parity and admits or
rejects; a failure retires the candidate and quarantines the key.

Lock order: an engine's lifecycle lock, then the runner's lock, then its cache's lock. Every
method here runs under the runner's lock.
"""

from __future__ import annotations

import enum
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from graphguard.core.admission import AdmissionPolicy, Clock
from graphguard.core.backends import Backend
from graphguard.core.background import CaptureJob, CaptureUnits, Reservation
from graphguard.core.cache import GraphCache, Retirable
from graphguard.core.decisions import (
    OUTCOMES,
    Action,
    Agreement,
    Decision,
    Orders,
    RankDivergence,
    Verified,
    next_unit,
    vote_of,
)
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics, RunnerCounts
from graphguard.core.reasons import CaptureOutcome, FallbackReason

log = logging.getLogger("graphguard")

# The reason a call falls back with when its capture ends in each rejected outcome.
_REJECTED = {
    CaptureOutcome.FAILED: FallbackReason.CAPTURE_FAILED,
    CaptureOutcome.PARITY_MISMATCH: FallbackReason.PARITY_MISMATCH,
    CaptureOutcome.OVER_BUDGET: FallbackReason.OVER_BUDGET,
}

E = TypeVar("E", bound=Retirable)  # what the runner's cache holds: an entry, or a group
C = TypeVar("C")  # one call's arguments, as the runner's hooks read them


class CaptureMode(enum.Enum):
    """Why a key is captured, which decides how its graph may enter the cache."""

    ON_CALL = "on_call"  # a call earned it: it may evict, and its first replay answers the call
    BACKGROUND = "background"  # a call earned it, captured between calls on example inputs
    WARMUP = "warmup"  # warm-up or prewarm: it takes free room only, and answers no call


# What a capture returns: (the call's answer, None), or (an eager answer or None, the reason).
Outcome = tuple[Any, FallbackReason | None]
# What a runner's capture hook returns (decisions.Verified): (graph outputs, eager outputs if
# they answer the call else None, None), or (None, eager outputs or None, the reason).


class CaptureFlow(ABC, Generic[E, C]):
    """Capture, verification and admission of candidates (see module docstring)."""

    # Set by RunnerBase.__init__.
    name: str
    strict: bool
    clock: Clock
    backend: Backend | None
    metrics: GraphMetrics
    policy: AdmissionPolicy
    _cache: GraphCache[E]
    _counts: RunnerCounts
    _lock: threading.RLock
    _job: CaptureJob[Outcome] | None  # the capture between calls, if any
    _num_units: int  # units of captures between calls run so far
    _max_unit_s: float  # the longest of them
    agreement: Agreement  # how ranks agree on each unit of capture work (one process: itself)
    orders: Orders | None  # where decisions come from on a tensor-parallel rank

    # -- capturing -------------------------------------------------------------------------
    def _capture(self, call: C, plan: CallPlan, mode: CaptureMode) -> Outcome:
        """Capture `plan.key` on `call` now, every unit at once (ON_CALL or WARMUP)."""
        job = self._new_job(plan.key, lambda: (call, plan), mode)
        outcome = job.run()
        self._observe(job)
        return outcome

    def _new_job(
        self, key: GraphKey, inputs: Callable[[], tuple[C, CallPlan]], mode: CaptureMode
    ) -> CaptureJob[Outcome]:
        reservation = None
        if mode is not CaptureMode.WARMUP:
            # NOTE: the capture in flight reserves its expected bytes: eviction comes first, so
            # the device never holds more than the budget while the candidate captures.
            reservation = Reservation(self._cache)
            reservation.cover(self._expected_bytes(key))
        candidate = self._new_candidate(key)
        units = self._capture_units(candidate, inputs, mode, reservation)
        return CaptureJob(key, candidate, reservation, units, self.clock, self.policy.record_work)

    def _capture_units(
        self,
        candidate: E,
        inputs: Callable[[], tuple[C, CallPlan]],
        mode: CaptureMode,
        reservation: Reservation | None,
    ) -> CaptureUnits[Outcome]:
        """Capture the candidate, check it against eager and admit it (see CaptureMode), one
        unit of work per step of the generator."""
        try:
            call, plan = inputs()
            verified = yield from self._held_units(candidate, call, plan, reservation)
            outputs, eager, reason = verified
            if reservation is not None:
                reservation.release()  # the candidate's own bytes become its charge
            if reason is not None:
                return eager, reason
            return self._admit(candidate, outputs, eager, plan, mode)
        except BaseException:
            candidate.retire()  # whatever escapes (a cancel too), its stream and pool go back
            raise
        finally:
            if reservation is not None:
                reservation.release()

    def _held_units(
        self, candidate: E, call: C, plan: CallPlan, reservation: Reservation | None
    ) -> CaptureUnits[Verified]:
        """The runner's capture units; after each one the ranks agree on how it went (one
        process agrees with itself) and the cache holds the candidate's agreed bytes."""
        units = self._capture_verified(candidate, call, plan)
        try:
            while True:
                verified = next_unit(units)
                vote = self.agreement.agree(vote_of(candidate.resident_bytes, verified))
                if vote.outcome is not None:
                    return self._agreed_rejection(candidate, verified, vote.outcome)
                if vote.resident_bytes != candidate.resident_bytes:
                    # NOTE: every rank charges the largest rank's bytes: the budget holds on each
                    # and their caches, fed the same calls, choose the same victims.
                    setattr(candidate, "resident_bytes", vote.resident_bytes)  # noqa: B010
                if verified is not None:
                    return verified
                if reservation is not None and not reservation.cover(candidate.resident_bytes):
                    self.policy.size_hints[candidate.key] = candidate.resident_bytes
                    return None, None, self._reject(candidate, CaptureOutcome.OVER_BUDGET, None)
                yield
        finally:
            units.close()

    def _agreed_rejection(
        self, candidate: E, verified: Verified | None, outcome: CaptureOutcome
    ) -> Verified:
        """Reject with the agreed outcome; this rank may have rejected on its own already."""
        local = OUTCOMES.get(verified[2]) if verified is not None and verified[2] else None
        if local is None:
            error = RankDivergence(f"{outcome} on another rank")
            return None, None, self._reject(candidate, outcome, error)
        if local is CaptureOutcome.OVER_BUDGET and outcome is not local:
            self._quarantine(candidate.key, f"{outcome} on another rank")
        assert verified is not None
        return None, verified[1], _REJECTED[outcome]

    def _admit(
        self, candidate: E, outputs: Any, eager: Any, plan: CallPlan, mode: CaptureMode
    ) -> Outcome:
        key, size = candidate.key, candidate.resident_bytes
        self._count_capture(key, size)
        # NOTE: a warm-up capture never evicts: it must not displace graphs that calls earned.
        fits = mode is not CaptureMode.WARMUP or self._cache.victims_for(size) == []
        if not (fits and self._cache.admit(candidate)):
            return eager, self._reject(candidate, CaptureOutcome.OVER_BUDGET, None)
        self._counts.capture(CaptureOutcome.ADMITTED)
        if mode is CaptureMode.ON_CALL:
            self._counts.replay()  # the verified first replay answers this call
        self._sync_gauges()
        return self._admitted(candidate, outputs, plan, mode), None

    # -- captures between calls --------------------------------------------------------------
    def advance_capture(self) -> bool:
        """Run the next unit of the capture in flight between calls, if any. Call it between
        calls (the engine: once per step, on its step thread). Returns True while a capture
        remains in flight. The kill switch, a disabled or a closed runner cancel it."""
        if self.orders is not None:  # a tensor-parallel rank (graphguard.core.decisions)
            return self.orders.between_calls(self)  # type: ignore[arg-type]
        with self._lock:
            return self._advance(self._advance_decision())

    def _advance_decision(self) -> Decision:
        """What to do between calls (under the lock): the leader's half of advance_capture."""
        job = self._job
        if job is None:
            return Decision(Action.IDLE)
        if self._gate() is not None:
            return Decision(Action.CANCEL, job.key)
        return Decision(Action.ADVANCE, job.key)

    def _advance(self, decision: Decision) -> bool:
        """Carry out a decision between calls (under the lock); True while a capture remains."""
        job = self._job
        if decision.action is Action.IDLE or job is None:
            if job is not None or decision.action is not Action.IDLE:
                raise RankDivergence(f"{self.name}: capture in flight differs from the leader's")
            return False
        if job.key != decision.key:
            raise RankDivergence(f"{self.name}: capturing {job.key.describe()}, not the leader's")
        if decision.action is Action.CANCEL:
            self._cancel_job()
            return False
        try:
            is_done = job.advance()
        except Exception as exc:
            self._job = None  # the capture's cleanup retired the candidate
            self._reject(job.candidate, CaptureOutcome.FAILED, exc)
            return False
        finally:
            self._num_units += 1
            self._max_unit_s = max(self._max_unit_s, job.max_unit_s)
            self._sync_gauges()
        if is_done:
            self._job = None
            self._observe(job)
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

    def _observe(self, job: CaptureJob[Outcome]) -> None:
        """An ended capture: its work into the capture-time histogram, and into the price of
        the key's captures (the admission's payback rule), if it was admitted."""
        if job.result is not None and job.result[1] is None:
            self.metrics.capture_seconds.observe(job.seconds)
            self.policy.record_price(job.key, job.seconds)

    # -- hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _new_candidate(self, key: GraphKey) -> E:
        """An empty entry for `key`, owning its pool and stream until it retires."""

    @abstractmethod
    def _capture_verified(self, candidate: E, call: C, plan: CallPlan) -> CaptureUnits[Verified]:
        """Capture `candidate` on `call` and compare its first replay with eager, yielding
        between bounded units of work (a warm-up, the capture, the parity check): returns
        (graph outputs, eager outputs if they answer the call else None, None); or, the
        candidate rejected (self._reject), (None, eager outputs or None, the reason)."""

    @abstractmethod
    def _admitted(self, candidate: E, outputs: Any, plan: CallPlan, mode: CaptureMode) -> Any:
        """An admitted candidate's log line, and its first outputs as the call's answer when
        a call earned it (ON_CALL; else None)."""

    @abstractmethod
    def _example(self, key: GraphKey) -> tuple[C, CallPlan]:
        """Inputs of `key` that a capture between calls may run on at any time (all-padding
        rows: they write only state no real row reads), and their plan."""

    @abstractmethod
    def _gate(self) -> FallbackReason | None:
        """Why no graph may run now (the kill switch, disabled, closed), if so."""

    @abstractmethod
    def _sync_gauges(self) -> None:
        """Move the shared gauges to this runner's state."""

    # -- bookkeeping -----------------------------------------------------------------------
    def _expected_bytes(self, key: GraphKey) -> int:
        """What a capture of `key` is expected to hold: its last size, else the mean entry's."""
        hint = self.policy.size_hints.get(key)
        return hint if hint is not None else self._cache.mean_entry_bytes()

    def _count_capture(self, key: GraphKey, resident_bytes: int) -> None:
        """A verified capture about to be admitted: admission history and thrash metrics (its
        work was counted unit by unit)."""
        backoffs = self.policy.counters.thrash_backoffs
        self.policy.record_admitted(key, resident_bytes)
        self.metrics.thrash_backoffs.inc(self.policy.counters.thrash_backoffs - backoffs)

    def _reject(
        self, candidate: E, outcome: CaptureOutcome, error: Exception | None
    ) -> FallbackReason:
        """Retire a candidate that failed capture, parity or the budget; quarantine failures.
        Returns the reason its call falls back with."""
        candidate.retire()
        assert self.backend is not None
        self.backend.trim()
        self._counts.capture(outcome)
        if outcome is CaptureOutcome.OVER_BUDGET:
            log.info(
                "graphguard over_budget key=%s bytes=%d budget=%d runner=%s",
                candidate.key.describe(), candidate.resident_bytes, self._cache.max_bytes,
                self.name,
            )  # fmt: skip
        else:
            self._quarantine(candidate.key, f"{outcome}: {error}")
            if self.strict and error is not None:
                raise error
        return _REJECTED[outcome]

    def _quarantine(self, key: GraphKey, why: str) -> None:
        delay = self.policy.quarantine(key)
        self._sync_gauges()
        log.warning(
            "graphguard quarantine key=%s backoff_s=%.1f why=%s", key.describe(), delay, why
        )
