"""The admission policy: capture only when it pays (fake clock, SimBackend)."""

import pytest

import graphguard as gg
from graphguard.core.admission import AdmissionConfig, AdmissionPolicy
from graphguard.core.keys import GraphKey
from graphguard.core.sketch import FrequencySketch
from tests.unit.core.conftest import SEG, inputs
from tests.unit.core.stand_ins import kernel


def width_inputs(width: int):
    return inputs(2, width=width, seed=width)


def test_a_key_is_captured_only_after_min_hits_sightings(make_runner):
    runner = make_runner(admission=AdmissionConfig(min_hits=3))
    for _ in range(2):
        runner(*width_inputs(4))
    assert runner.stats()["fallbacks"] == {"admission_deferred": 2}
    runner(*width_inputs(4))
    assert runner.stats()["captures"] == 1


def test_one_off_shapes_run_eagerly_with_the_default_policy(clock):
    runner = gg.GraphRunner(lambda x, p: x + p, backend="sim", clock=clock)
    for width in range(3, 10):
        runner(*width_inputs(width))
    assert runner.stats()["captures"] == 0
    assert runner.stats()["fallbacks"] == {"admission_deferred": 7}


def test_capture_work_stays_under_its_share_of_the_window(make_runner, clock):
    slow = kernel(lambda x: clock.advance(1.0))  # every run "takes" a second of the clock

    def slow_capture_step(x, p):
        return slow(x) + p

    config = AdmissionConfig(min_hits=1, capture_window_s=60.0, max_capture_fraction=0.1)
    runner = make_runner(slow_capture_step, admission=config)
    for width in range(3, 8):
        runner(*width_inputs(width))
    # each capture costs 3 s of fake time (capture run, first replay, eager parity run); the
    # window allows 6 s, so the second capture reaches it and the rest wait
    assert runner.stats()["captures"] == 2
    assert runner.stats()["fallbacks"]["admission_deferred"] == 3
    clock.advance(61.0)
    runner(*width_inputs(9))
    assert runner.stats()["captures"] == 3


def test_a_new_key_displaces_residents_only_if_it_is_used_more_often(make_runner):
    runner = make_runner(max_bytes=2 * SEG + 8192, admission=AdmissionConfig(min_hits=1))
    for _ in range(3):
        runner(*width_inputs(4))
        runner(*width_inputs(5))
    runner(*width_inputs(6))  # seen once; residents seen three times each
    assert sorted(k.args[0].shape[1] for k in runner.admitted_keys()) == [4, 5]
    for _ in range(4):
        runner(*width_inputs(6))
    assert 6 in [k.args[0].shape[1] for k in runner.admitted_keys()]


def test_eight_cycling_shapes_under_a_three_graph_budget_keep_captures_bounded(make_runner):
    runner = make_runner(max_bytes=3 * SEG + 3 * 4096, admission=AdmissionConfig())
    shapes = list(range(4, 12))
    for _ in range(50):
        for width in shapes:
            runner(*width_inputs(width))
    after_50 = runner.stats()["captures"]
    for _ in range(50):
        for width in shapes:
            runner(*width_inputs(width))
    assert runner.stats()["captures"] == after_50 <= 4
    assert runner.stats()["entries"] == 3


def test_the_three_hottest_of_eight_shapes_stay_resident(make_runner):
    runner = make_runner(max_bytes=3 * SEG + 3 * 4096, admission=AdmissionConfig())
    hot, cold = [4, 5, 6], [7, 8, 9, 10, 11]
    for round_ in range(40):
        for width in hot:
            runner(*width_inputs(width))
            runner(*width_inputs(width))
        runner(*width_inputs(cold[round_ % len(cold)]))
    assert sorted(k.args[0].shape[1] for k in runner.admitted_keys()) == hot
    assert runner.stats()["captures"] <= 6


def test_a_key_evicted_and_recaptured_too_often_is_backed_off(make_runner, clock):
    config = AdmissionConfig(min_hits=1, frequency_aware=False, max_recaptures=2)
    runner = make_runner(max_bytes=SEG + 4096, admission=config)
    for _ in range(4):
        runner(*width_inputs(4))
        runner(*width_inputs(5))
    stats = runner.stats()
    assert stats["admission"]["thrash_backoffs"] >= 1
    assert stats["fallbacks"].get("thrashing", 0) >= 1


def test_thrash_backoff_expires(make_runner, clock):
    config = AdmissionConfig(
        min_hits=1, frequency_aware=False, max_recaptures=1, backoff_initial_s=5.0
    )
    runner = make_runner(max_bytes=SEG + 4096, admission=config)
    runner(*width_inputs(4))
    runner(*width_inputs(5))  # evicts 4
    runner(*width_inputs(4))  # recapture of an evicted key: backed off from now on
    assert runner.policy.blocked(runner.admitted_keys()[0]) is gg.FallbackReason.THRASHING
    clock.advance(6.0)
    assert runner.policy.blocked(runner.admitted_keys()[0]) is None


def test_warmup_captures_largest_first_within_the_budget(make_runner):
    runner = make_runner(max_bytes=2 * SEG + 16384, admission=AdmissionConfig(min_hits=5))
    report = runner.warmup([inputs(r, width=8) for r in (1, 4, 2)], progress=False)
    assert [k.args[0].shape[0] for k in runner.admitted_keys()] == [4, 2]
    assert len(report.captured) == 2 and list(report.skipped.values()) == ["over_budget"]


def test_prewarmed_mode_replays_only_warmed_keys(make_runner):
    runner = make_runner(admission=AdmissionConfig(mode="prewarmed"))
    runner.warmup([inputs(2)], progress=False)
    runner(*inputs(2))
    runner(*inputs(3))
    stats = runner.stats()
    assert stats["replays"] == 1  # this call; the warm-up replay answered no call
    assert stats["fallbacks"] == {"not_prewarmed": 1}


def test_policy_rejects_invalid_configuration():
    with pytest.raises(ValueError):
        AdmissionConfig(min_hits=0)
    with pytest.raises(ValueError):
        AdmissionConfig(mode="eager-only")


def test_sketch_estimates_frequencies_and_forgets_with_age():
    sketch = FrequencySketch(width=64, sample_size=100)
    for _ in range(30):
        sketch.add("hot")
    sketch.add("cold")
    assert sketch.estimate("hot") >= 30 > sketch.estimate("cold")
    for i in range(100):
        sketch.add(("filler", i))
    assert sketch.estimate("hot") <= 20  # halved at least once


def test_hit_rate_and_capture_seconds_are_reported(make_runner):
    runner = make_runner()
    for _ in range(4):
        runner(*inputs(2))
    stats = runner.stats()
    assert stats["hit_rate"] == 1.0
    assert stats["admission"]["capture_seconds"] >= 0.0


def test_quarantine_doubles_its_backoff():
    now = [0.0]
    policy = AdmissionPolicy(
        AdmissionConfig(backoff_initial_s=1.0, backoff_max_s=4.0), lambda: now[0]
    )
    key = GraphKey(("k",))
    assert [policy.quarantine(key) for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]


def test_a_prewarmed_key_is_captured_again_after_an_invalidation(make_runner):
    runner = make_runner(admission=AdmissionConfig(min_hits=3))
    runner.warmup([inputs(2)], progress=False)
    runner.invalidate()  # new weights, say
    runner(*inputs(2))
    stats = runner.stats()
    assert stats["entries"] == 1 and stats["fallbacks"] == {}
