"""A capture as bounded units of work, so that it can run between calls instead of inside one.

A runner's capture is a generator: each `next()` runs one unit (a graph's static inputs and
first warm-up, another warm-up, the capture, the parity check; for segment groups the same per
segment) and the generator's return value is the capture's outcome. In a call or at warm-up
the runner runs every unit at once (CaptureJob.run). In the background the call that earns the
key answers eagerly (`capture_in_progress`) and whoever drives the runner calls
`advance_capture()` between its calls, one unit each time: the engine does so once per step,
on its step thread, so a capture never overlaps a step and no step waits for more than one
unit. The new graph is admitted between calls, once it has passed parity.

A capture in flight holds its bytes in the cache (a Reservation): its expected size when it
starts, and at least the candidate's measured bytes after every unit, so the cache never lets
the budget be exceeded while it runs. Cancelling (invalidate, close, the kill switch) closes
the generator between units: its cleanup retires the candidate and gives the bytes back.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

from graphguard.core.keys import GraphKey

R = TypeVar("R")
# One capture: yields between units of work, returns its outcome.
CaptureUnits = Generator[None, None, R]


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


class CaptureJob(Generic[R]):
    """One key's capture, run one unit at a time (see module docstring).

    Every unit's time, by the runner's clock, goes to `on_work` as soon as the unit ends (the
    admission policy's capture-work budget), whether the capture is admitted in the end or not.
    """

    def __init__(
        self,
        key: GraphKey,
        candidate: Any,
        reservation: Reservation | None,
        units: CaptureUnits[R],
        clock: Callable[[], float],
        on_work: Callable[[float], None],
    ) -> None:
        self.key = key
        self.candidate = candidate  # the entry or group being captured (retired on any failure)
        self.reservation = reservation  # the bytes it holds in the cache (None: at warm-up)
        self._units = units
        self._clock = clock
        self._on_work = on_work
        self.num_units = 0
        self.seconds = 0.0  # the units' time so far
        self.max_unit_s = 0.0
        self.result: R | None = None
        self.is_done = False

    def advance(self) -> bool:
        """Run the next unit; True once the capture has ended (its outcome in `result`)."""
        started = self._clock()
        try:
            next(self._units)
        except StopIteration as stop:
            self.result, self.is_done = stop.value, True
        finally:
            self._count(self._clock() - started)
        return self.is_done

    def run(self) -> R:
        """Every unit now; the capture's outcome."""
        while not self.advance():
            pass
        return self.result  # type: ignore[return-value]

    def cancel(self) -> None:
        """Stop between units: retire the candidate and give its bytes back.

        NOTE: closing a generator that never ran skips its cleanup, so the job does both
        itself (each is idempotent) rather than rely on the capture's own."""
        self._units.close()
        self.candidate.retire()
        if self.reservation is not None:
            self.reservation.release()
        self.is_done = True

    def _count(self, seconds: float) -> None:
        self.num_units += 1
        self.seconds += seconds
        self.max_unit_s = max(self.max_unit_s, seconds)
        self._on_work(seconds)
