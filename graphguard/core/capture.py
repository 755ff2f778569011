"""One capture as a plain object: a candidate, the bytes it reserves, its units of work, and
the Verdict they end in.

A runner's capture of one key is a generator of bounded units of work (a graph's static
inputs and first warm-up, another warm-up, the capture, the parity check; for segment groups
the same per segment) that returns a Verdict. In the call that earned the key, or at warm-up,
the job runs every unit at once (`run`). In the background the call answers eagerly
(`capture_in_progress`) and whoever drives the runner calls `advance_capture()` between its
calls, one unit each time: the engine does so once per step, on its step thread, so a capture
never overlaps a step and no step waits for more than one unit.

A capture in flight holds its bytes in the cache (a Reservation): its expected size when it
starts, and at least the candidate's measured bytes after every unit, so the budget is never
exceeded while it runs; a candidate that outgrows the room ends OVER_BUDGET. The reservation is
given back when the work ends: an admitted candidate's own bytes become its charge. Cancelling
(invalidate, close, the kill switch) closes the generator between units, retires the candidate
and gives the bytes back. Admitting or rejecting the candidate is the runner's (its `_settle`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from graphguard.core.cache import Retirable
from graphguard.core.inputs import CallPlan
from graphguard.core.reasons import CaptureOutcome, FallbackReason
from graphguard.core.state import StateRefused, StepState

E = TypeVar("E", bound=Retirable)  # what is captured: an entry, or a group of segment entries
C = TypeVar("C")  # one call's arguments, as the runner's kind reads them


class CaptureMode(enum.Enum):
    """Why a key is captured, which decides how its graph may enter the cache."""

    ON_CALL = "on_call"  # a call earned it: it may evict, and its first replay answers the call
    BACKGROUND = "background"  # a call earned it, captured between calls on example inputs
    WARMUP = "warmup"  # warm-up or prewarm: it takes free room only, and answers no call


@dataclass(frozen=True)
class Verdict:
    """How a capture's work ended. `outcome` None: the candidate passed, and `outputs` are its
    first replay's. Else the rejection and the error behind it. `eager`: an eager answer of the
    call the capture ran on, when the parity check produced one (segment groups)."""

    outputs: Any = None
    eager: Any = None
    outcome: CaptureOutcome | None = None
    error: BaseException | None = None
    # the step's state (graphguard/core/state.py): after a pass it holds the first replay's
    # writes, which a capture that answers no call, or is not admitted, undoes
    state: StepState | None = None
    refusal: FallbackReason | None = None  # with STATE_REFUSED: the named reason

    @classmethod
    def rejected(
        cls, outcome: CaptureOutcome, error: BaseException | None = None, eager: Any = None
    ) -> Verdict:
        return cls(eager=eager, outcome=outcome, error=error)

    @classmethod
    def refused(cls, error: StateRefused, eager: Any = None) -> Verdict:
        """The step's state cannot be put back: the key runs eagerly for good."""
        return cls(eager=eager, outcome=CaptureOutcome.STATE_REFUSED, error=error,
                   refusal=error.reason)  # fmt: skip


@dataclass
class WarmupReport:
    """What a warm-up captured, and why it skipped the rest."""

    captured: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # key -> reason
    seconds: float = 0.0

    def add(self, other: WarmupReport) -> None:
        """Count `other`'s captures, skips and time in this report."""
        self.captured += other.captured
        self.skipped.update(other.skipped)
        self.seconds += other.seconds


# One capture's work: yields between units, returns its Verdict.
CaptureUnits = Generator[None, None, Verdict]


def next_unit(units: CaptureUnits) -> Verdict | None:
    """Run one unit of capture work: None while the capture goes on, else its Verdict."""
    try:
        next(units)
    except StopIteration as stop:
        return stop.value
    return None


class _Reserving(Protocol):
    def reserve(self, num_bytes: int) -> bool: ...
    def unreserve(self, num_bytes: int) -> None: ...


class Reservation:
    """The bytes one capture in flight holds in its runner's cache (GraphCache.reserve)."""

    def __init__(self, cache: _Reserving) -> None:
        self._cache = cache
        self.num_bytes = 0

    def cover(self, num_bytes: int) -> bool:
        """Hold at least `num_bytes`, evicting what the cache must to make room; False (and
        nothing more held) when they cannot fit."""
        extra = num_bytes - self.num_bytes
        if extra <= 0:
            return True
        if not self._cache.reserve(extra):
            return False
        self.num_bytes = num_bytes
        return True

    def release(self) -> None:
        """Give every held byte back. Idempotent."""
        held, self.num_bytes = self.num_bytes, 0
        if held:
            self._cache.unreserve(held)


class CaptureJob(Generic[E, C]):
    """One key's capture, run one unit at a time (see module docstring).

    `inputs()` gives the call it captures on and that call's plan; it runs in the first unit
    (a capture between calls builds example inputs then). `units(candidate, call, plan)` is
    the kind's capture work. Every unit's time, by `clock`, goes to `on_work` as soon as the
    unit ends (the admission policy's capture-work budget), admitted in the end or not.
    """

    def __init__(
        self,
        candidate: E,
        mode: CaptureMode,
        inputs: Callable[[], tuple[C, CallPlan]],
        units: Callable[[E, C, CallPlan], CaptureUnits],
        reservation: Reservation | None,
        clock: Callable[[], float],
        on_work: Callable[[float], None],
    ) -> None:
        self.candidate = candidate  # retired on any failure, by the runner on a rejection
        self.key = candidate.key
        self.mode = mode
        self.reservation = reservation  # None at warm-up, which takes free room only
        self.plan: CallPlan | None = None  # the plan of the call it captures on, once known
        self._work = self._units(inputs, units)
        self._clock = clock
        self._on_work = on_work
        self.num_units = 0
        self.seconds = 0.0  # the units' time so far
        self.max_unit_s = 0.0
        self.verdict: Verdict | None = None

    def advance(self) -> bool:
        """Run the next unit; True once the capture has ended (its Verdict in `verdict`)."""
        started = self._clock()
        try:
            self.verdict = next_unit(self._work)
        finally:
            self._count(self._clock() - started)
        return self.verdict is not None

    def run(self) -> Verdict:
        """Every unit now; the capture's Verdict."""
        while not self.advance():
            pass
        assert self.verdict is not None
        return self.verdict

    def cancel(self) -> None:
        """Stop between units: retire the candidate and give its bytes back.

        NOTE: closing a generator that never ran skips its cleanup, so the job does both
        itself (each is idempotent) rather than rely on the work's own."""
        self._work.close()
        self.candidate.retire()
        if self.reservation is not None:
            self.reservation.release()
        self.verdict = Verdict.rejected(CaptureOutcome.CANCELLED)

    def _units(
        self,
        inputs: Callable[[], tuple[C, CallPlan]],
        units: Callable[[E, C, CallPlan], CaptureUnits],
    ) -> CaptureUnits:
        """The kind's units, each followed by the reservation's check of the candidate's
        bytes; whatever escapes (a cancel too) retires the candidate."""
        candidate, reservation = self.candidate, self.reservation
        try:
            call, self.plan = inputs()
            work = units(candidate, call, self.plan)
            try:
                while (verdict := next_unit(work)) is None:
                    held = candidate.resident_bytes + candidate.transient_bytes
                    if reservation is not None and not reservation.cover(held):
                        return Verdict.rejected(CaptureOutcome.OVER_BUDGET)
                    yield
                return verdict
            finally:
                work.close()
        except BaseException:
            candidate.retire()  # its stream and pool go back
            raise
        finally:
            if reservation is not None:
                reservation.release()

    def _count(self, seconds: float) -> None:
        self.num_units += 1
        self.seconds += seconds
        self.max_unit_s = max(self.max_unit_s, seconds)
        self._on_work(seconds)
