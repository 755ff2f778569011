"""Captures between calls (CaptureConfig(background=True)): the key's calls run eagerly with
`capture_in_progress` while advance_capture() runs one unit of work at a time; the graph is
admitted between calls; the bytes are held while it runs; invalidate, close and the kill switch
cancel it cleanly; its work counts toward the capture-time budget."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.core.reasons import FallbackReason
from graphguard.core.sim import SimBackend
from tests.unit.core.conftest import SEG, inputs, mlp_step
from tests.unit.core.stand_ins import kernel

BUCKETS = gg.Buckets(batch=[2, 4], pad_value=0)
EAGER_FIRST = gg.AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend(num_warmup=2)


@pytest.fixture
def make_bg(make_runner, backend):
    def make(fn=mlp_step, **kwargs):
        kwargs.setdefault("buckets", BUCKETS)
        kwargs.setdefault("admission", EAGER_FIRST)
        return make_runner(fn, backend=backend, background=True, **kwargs)

    return make


def drain(runner: gg.GraphRunner) -> int:
    """Advance the capture in flight to its end; how many units that took."""
    units = 1
    while runner.advance_capture():
        units += 1
    return units


def assert_same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_the_call_that_earns_a_key_answers_eagerly_with_capture_in_progress(make_bg, backend):
    runner = make_bg()
    x, pos = inputs(2)
    assert_same(runner(x, pos), mlp_step(x, pos))
    assert backend.num_captures == 0  # nothing was captured inside the call
    assert runner.stats()["fallbacks"] == {"capture_in_progress": 1}
    assert runner.capture_in_flight is not None


def test_calls_of_the_key_run_eagerly_until_the_graph_is_admitted_then_replay(make_bg):
    runner = make_bg()
    x, pos = inputs(2)
    runner(x, pos)
    runner.advance_capture()
    assert_same(runner(x, pos), mlp_step(x, pos))  # still in flight: eager
    drain(runner)
    assert runner.capture_in_flight is None and runner.stats()["entries"] == 1
    assert_same(runner(x, pos), mlp_step(x, pos))
    stats = runner.stats()
    assert stats["replays"] == 1 and stats["fallbacks"] == {"capture_in_progress": 2}
    assert stats["calls"] == stats["replays"] + sum(stats["fallbacks"].values())


def test_each_advance_runs_one_unit_warm_ups_capture_then_parity(make_bg, backend):
    runner = make_bg()
    runner(*inputs(2))
    progress = []
    while True:
        more = runner.advance_capture()
        progress.append((backend.num_warmups, backend.num_captures, runner.stats()["entries"]))
        if not more:
            break
    # static inputs, the record run (a warm-up of the backend's) and the first warm-up; the
    # second warm-up; the capture; the first replay and its check against the record run
    assert progress == [(2, 0, 0), (3, 0, 0), (3, 1, 0), (3, 1, 1)]
    assert runner.stats()["background_units"] == 4


def test_a_background_capture_runs_on_padding_rows_not_on_the_calls_inputs(make_bg):
    seen: list[torch.Tensor] = []

    def step(ids: torch.Tensor) -> torch.Tensor:
        seen.append(ids.clone())
        return ids * 2

    runner = make_bg(step, buckets=gg.Buckets(batch=[4], pad_value=-7))
    runner(torch.tensor([1, 2, 3]))
    call_inputs = len(seen)
    drain(runner)
    assert len(seen) > call_inputs
    assert all(torch.equal(ids, torch.full((4,), -7)) for ids in seen[call_inputs:])


def test_examples_give_the_inputs_of_a_capture_between_calls(make_bg):
    seen: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return x + 1

    def examples(key):
        return (torch.full(key.args[0].shape, 5.0),)

    runner = make_bg(step, buckets=None, examples=examples)
    runner(torch.zeros(3))
    drain(runner)
    assert all(torch.equal(x, torch.full((3,), 5.0)) for x in seen[1:])


def test_background_without_buckets_or_examples_is_refused():
    with pytest.raises(ValueError, match="example inputs"):
        gg.GraphRunner(mlp_step, backend="sim", capture=gg.CaptureConfig(background=True))


def test_another_key_waits_while_a_capture_is_in_flight(make_bg):
    runner = make_bg()
    runner(*inputs(2))
    runner(*inputs(4))
    assert runner.stats()["fallbacks"] == {"capture_in_progress": 1, "admission_deferred": 1}
    drain(runner)
    runner(*inputs(4))  # the first capture ended: this key starts its own
    assert runner.stats()["fallbacks"]["capture_in_progress"] == 2


def test_a_capture_in_flight_reserves_its_expected_bytes(make_bg):
    runner = make_bg(max_bytes=4 * SEG)
    runner(*inputs(2))
    drain(runner)
    size = runner.stats()["resident_bytes"]
    runner(*inputs(4))
    stats = runner.stats()
    assert stats["reserved_bytes"] == size  # the mean admitted graph, before any work
    assert stats["resident_bytes"] + stats["reserved_bytes"] <= stats["max_bytes"]
    drain(runner)
    assert runner.stats()["reserved_bytes"] == 0


def test_the_budget_holds_after_every_unit(make_bg):
    runner = make_bg(max_bytes=2 * SEG)
    runner(*inputs(2))
    drain(runner)
    runner(*inputs(4))
    while True:
        more = runner.advance_capture()
        stats = runner.stats()
        assert stats["resident_bytes"] + stats["reserved_bytes"] <= stats["max_bytes"]
        if not more:
            break


def test_the_reservation_evicts_before_the_capture_starts(make_bg):
    runner = make_bg(max_bytes=SEG)  # room for one graph
    runner(*inputs(2))
    drain(runner)
    (first,) = runner._cache.entries()
    runner(*inputs(4))
    assert first.is_retired and runner.stats()["reserved_bytes"] == SEG


def test_a_candidate_that_outgrows_the_budget_in_flight_is_over_budget(make_bg):
    runner = make_bg(max_bytes=SEG)
    big = (torch.randn(4, 200_000), torch.randn(4, 200_000))  # static inputs alone exceed SEG
    runner(*big)
    drain(runner)
    assert runner.stats()["entries"] == 0 and runner.stats()["reserved_bytes"] == 0
    runner(*big)
    assert runner.stats()["fallbacks"]["over_budget"] == 1  # remembered: never captured again


def test_invalidate_cancels_the_capture_in_flight_and_retires_its_candidate(make_bg, backend):
    runner = make_bg()
    runner(*inputs(2))
    runner.advance_capture()
    runner.invalidate()
    stats = runner.stats()
    assert runner.capture_in_flight is None and stats["reserved_bytes"] == 0
    assert stats["captures_cancelled"] == 1 and stats["captures"] == 0
    assert not backend.live_streams  # the candidate's stream was released
    assert runner.advance_capture() is False
    runner(*inputs(2))  # a new capture starts from scratch, on the new state
    assert runner.capture_in_flight is not None and runner.stats()["entries"] == 0


def test_close_cancels_the_capture_in_flight(make_bg, backend):
    runner = make_bg()
    runner(*inputs(2))
    runner.advance_capture()
    runner.close()
    assert runner.stats()["captures_cancelled"] == 1 and not backend.live_streams
    x, pos = inputs(2)
    assert_same(runner(x, pos), mlp_step(x, pos))
    assert runner.stats()["fallbacks"]["closed"] == 1


def test_the_kill_switch_cancels_the_capture_in_flight(make_bg, backend, monkeypatch):
    runner = make_bg()
    runner(*inputs(2))
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    assert runner.advance_capture() is False
    assert runner.stats()["captures_cancelled"] == 1 and backend.num_captures == 0
    runner(*inputs(2))
    assert runner.stats()["fallbacks"]["kill_switch"] == 1


def test_a_background_capture_that_fails_quarantines_its_key(make_bg):
    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum())  # a host sync: no capture can hold it

    runner = make_bg(syncs)
    x = torch.ones(2)
    runner(x)
    drain(runner)
    stats = runner.stats()
    assert stats["capture_failures"] == 1 and stats["quarantined_keys"] == 1
    assert torch.equal(runner(x), syncs(x))
    assert runner.stats()["fallbacks"]["quarantined"] == 1


def test_a_background_capture_that_differs_from_eager_is_rejected(make_bg):
    flips = iter(range(1000))

    def drifting(x: torch.Tensor) -> torch.Tensor:
        return x + next(flips)  # a new value on every run: the replay never matches eager

    runner = make_bg(drifting)
    runner(torch.ones(2))
    drain(runner)
    assert runner.stats()["parity_mismatches"] == 1 and runner.stats()["entries"] == 0


def test_units_of_a_capture_in_flight_count_toward_the_capture_time_budget(make_bg, clock):
    second = kernel(lambda x: clock.advance(1.0))  # every run takes a second

    def slow(x: torch.Tensor) -> torch.Tensor:
        return second(x) * 2

    runner = make_bg(slow)
    runner(torch.ones(2))  # its eager answer's second is not capture work
    runner.advance_capture()  # static inputs, the record run and the first warm-up
    assert runner.stats()["admission"]["capture_seconds"] == 2.0
    assert runner.capture_in_flight is not None


def test_work_of_a_rejected_capture_counts_toward_the_capture_time_budget(make_bg, clock):
    second = kernel(lambda x: clock.advance(1.0))

    def slow_sync(x: torch.Tensor) -> torch.Tensor:
        return second(x) * float(x.sum())

    runner = make_bg(slow_sync)
    runner(torch.ones(2))
    drain(runner)
    assert runner.stats()["capture_failures"] == 1
    assert runner.stats()["admission"]["capture_seconds"] >= 2.0  # the two warm-ups


def test_a_spent_capture_budget_defers_the_next_background_capture(make_bg, clock):
    two_seconds = kernel(lambda x: clock.advance(2.0))

    def slow(x: torch.Tensor) -> torch.Tensor:
        return two_seconds(x) * 2

    budget = gg.AdmissionConfig(min_hits=1, capture_window_s=60, max_capture_fraction=0.05)
    runner = make_bg(slow, admission=budget)
    runner(torch.ones(2))
    drain(runner)  # 3 s of the window's budget of 3 s went to this capture's units
    runner(torch.ones(4))
    assert runner.stats()["fallbacks"]["admission_deferred"] == 1


def test_the_reason_is_a_label_of_the_fallback_metric(make_bg):
    runner = make_bg()
    runner(*inputs(2))
    value = runner.metrics.registry.get_sample_value(
        "graphguard_fallbacks_total", {"reason": FallbackReason.CAPTURE_IN_PROGRESS.value}
    )
    assert value == 1.0
    reserved = runner.metrics.registry.get_sample_value("graphguard_graph_reserved_bytes")
    assert reserved == runner.stats()["reserved_bytes"]


def test_a_capture_cancelled_before_its_first_unit_gives_everything_back(make_bg, backend):
    runner = make_bg(max_bytes=4 * SEG)
    runner(*inputs(2))
    drain(runner)
    runner(*inputs(4))  # its capture holds bytes and a stream, and has run no unit yet
    assert runner.stats()["reserved_bytes"] > 0 and len(backend.live_streams) == 2
    runner.invalidate()
    assert runner.stats()["reserved_bytes"] == 0 and not backend.live_streams
