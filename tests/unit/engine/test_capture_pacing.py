"""How much of a step a capture in flight may take (graphguard/engine/graphs/pacing.py): no unit
while prefills are pending, within a bound of steps in a row; else units up to a time slice."""

from __future__ import annotations

import pytest

from graphguard.engine.config import CapturePacing
from graphguard.engine.graphs.pacing import CapturePacer


class FakeCapture:
    """A capture of `num_units` units, each taking `unit_s` of a hand-driven clock."""

    def __init__(self, num_units: int, unit_s: float) -> None:
        self.now = 0.0
        self.num_left = num_units
        self.unit_s = unit_s
        self.num_run = 0

    def clock(self) -> float:
        return self.now

    def advance(self) -> bool:
        self.now += self.unit_s
        self.num_left -= 1
        self.num_run += 1
        return self.num_left > 0


def pacer(capture: FakeCapture, **pacing: float) -> CapturePacer:
    return CapturePacer(CapturePacing(**pacing), capture.advance, capture.clock)  # type: ignore[arg-type]


def test_a_step_with_pending_prefills_runs_no_unit() -> None:
    capture = FakeCapture(num_units=4, unit_s=0.05)
    assert pacer(capture).before_step(has_pending_prefills=True) == 0
    assert capture.num_run == 0


def test_a_capture_put_off_for_max_deferred_steps_runs_at_the_next_pending_step() -> None:
    capture = FakeCapture(num_units=4, unit_s=0.05)
    paced = pacer(capture, max_deferred_steps=2, max_deferred_ms=0.0)
    ran = [paced.before_step(has_pending_prefills=True) for _ in range(6)]
    assert ran == [0, 0, 1, 0, 0, 1]  # a queue that never empties still lets it finish
    assert paced.num_deferred_total == 4


def test_fast_steps_put_a_capture_off_for_max_deferred_ms_too() -> None:
    # Steps of 2 ms with prefills pending (a wave of arrivals under graphs): eight steps in a
    # row are only 16 ms, so the capture waits until 49 ms have passed, then runs a slice.
    capture = FakeCapture(num_units=8, unit_s=0.05)
    paced = pacer(capture, max_deferred_steps=8, max_deferred_ms=49.0)
    ran = []
    for _ in range(30):
        ran.append(paced.before_step(has_pending_prefills=True))
        capture.now += 0.002  # the step itself
    assert ran.index(1) == 25  # the first step that begins 49 ms or more after the first
    assert sum(ran) == 1


def test_a_step_without_pending_prefills_resets_the_count_of_deferred_steps() -> None:
    capture = FakeCapture(num_units=8, unit_s=0.05)
    paced = pacer(capture, max_deferred_steps=2, max_deferred_ms=0.0)
    paced.before_step(has_pending_prefills=True)
    paced.before_step(has_pending_prefills=False)
    assert [paced.before_step(has_pending_prefills=True) for _ in range(3)] == [0, 0, 1]


def test_short_units_run_until_the_slice_is_spent() -> None:
    capture = FakeCapture(num_units=40, unit_s=0.002)
    assert pacer(capture, slice_ms=9.0).before_step(has_pending_prefills=False) == 5
    assert capture.num_run == 5


def test_a_unit_longer_than_the_slice_runs_alone() -> None:
    capture = FakeCapture(num_units=4, unit_s=0.05)
    assert pacer(capture, slice_ms=10.0).before_step(has_pending_prefills=False) == 1


def test_the_slice_stops_when_the_capture_ends() -> None:
    capture = FakeCapture(num_units=3, unit_s=0.001)
    assert pacer(capture, slice_ms=1e4).before_step(has_pending_prefills=False) == 3


@pytest.mark.parametrize(
    "pacing", [{"max_deferred_steps": -1}, {"max_deferred_ms": -1.0}, {"slice_ms": -1.0}]
)
def test_negative_pacing_is_refused(pacing: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CapturePacing(**pacing)  # type: ignore[arg-type]
