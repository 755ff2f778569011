"""SegmentedRunner with CaptureConfig(background=True): a group is captured between calls, one
unit of work per advance_capture() (per segment: warm-ups, then capture and first replay; then
the parity run), on example inputs, and cancelled whole."""

from __future__ import annotations

import pytest
import torch

from graphguard.core.admission import AdmissionConfig
from graphguard.core.options import CaptureConfig
from graphguard.core.sim import SimBackend
from graphguard.segmented import SegmentedRunner
from tests.unit.test_segmented import STAGES, Ctx, assert_bitwise, x_of

EAGER_FIRST = AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend(num_warmup=1)


@pytest.fixture
def runner(backend):
    def examples(key):
        return (torch.ones(key.args[0].shape),), Ctx(scale=0.5)

    built = SegmentedRunner(
        STAGES,
        backend=backend,
        admission=EAGER_FIRST,
        capture=CaptureConfig(background=True, examples=examples),
    )
    yield built
    built.close()


def test_a_group_is_captured_one_unit_per_advance_while_calls_run_eagerly(runner, backend):
    x = x_of(3)
    assert_bitwise(runner([x], Ctx()), runner.eager([x], Ctx()))
    units = 0
    while runner.advance_capture():
        units += 1
        assert runner.stats()["groups"] == 0  # nothing admitted before the parity check
    # three segments of a warm-up and a capture each, then the parity run
    assert units + 1 == 3 * 2 + 1 and backend.num_captures == 3
    assert_bitwise(runner([x], Ctx()), runner.eager([x], Ctx()))
    stats = runner.stats()
    assert stats["replays"] == 1 and stats["fallbacks"] == {"capture_in_progress": 1}


def test_invalidate_mid_group_retires_every_captured_segment(runner, backend):
    runner([x_of(3)], Ctx())
    for _ in range(3):  # two segments in
        runner.advance_capture()
    runner.invalidate()
    assert not backend.live_streams  # the group's shared stream went back with its segments
    assert runner.stats()["captures_cancelled"] == 1 and runner.stats()["reserved_bytes"] == 0


def test_background_without_examples_is_refused():
    with pytest.raises(ValueError, match="examples"):
        SegmentedRunner(STAGES, backend=SimBackend(), capture=CaptureConfig(background=True))
