"""The runner surface that code above a runner uses (export and prewarm read nothing else):
resident(), plan(), max_bytes; and the capture modes: a call's capture may evict, a warm-up's
never does."""

from __future__ import annotations

import threading

import graphguard as gg
from graphguard.core.reasons import FallbackReason
from tests.unit.core.conftest import SEG, inputs

BUCKETS = gg.Buckets(batch=[2, 4])
EAGER_FIRST = gg.AdmissionConfig(min_hits=1, frequency_aware=False)


def test_resident_entries_are_pinned_until_the_block_ends(make_runner):
    runner = make_runner(buckets=BUCKETS)
    runner(*inputs(2))
    runner(*inputs(4))
    with runner.resident() as entries:
        # room for the whole budget would evict every unpinned entry
        assert not runner._cache.reserve(runner.max_bytes)
        assert len(entries) == 2 and not any(entry.is_retired for entry in entries)
    assert [entry.pin_count for entry in entries] == [0, 0]
    assert runner._cache.reserve(runner.max_bytes)
    assert all(entry.is_retired for entry in entries)
    runner._cache.unreserve(runner.max_bytes)


def test_calls_replay_on_other_threads_while_resident_entries_are_held(make_runner):
    runner = make_runner(buckets=BUCKETS)
    runner(*inputs(2))
    with runner.resident():
        call = threading.Thread(target=runner, args=inputs(2))
        call.start()
        call.join(timeout=30)
        assert not call.is_alive()  # the runner's lock is not held by the block
    assert runner.stats()["replays"] == 2


def test_plan_is_the_key_a_call_replays_under(make_runner):
    runner = make_runner(buckets=BUCKETS)
    plan = runner.plan(inputs(3))
    assert not isinstance(plan, FallbackReason)
    assert (plan.rows, plan.key.rows) == (3, 4)
    runner(*inputs(3))
    assert runner.admitted_keys() == [plan.key]
    assert runner.plan(inputs(5)) is FallbackReason.UNBUCKETED_SHAPE


def test_max_bytes_is_the_budget(make_runner):
    assert make_runner(max_bytes=3 * SEG).max_bytes == 3 * SEG


def test_a_capture_for_a_call_may_evict_a_graph_another_call_earned(make_runner):
    runner = make_runner(buckets=BUCKETS, max_bytes=SEG, admission=EAGER_FIRST)
    runner(*inputs(4))
    runner(*inputs(2))
    assert [key.rows for key in runner.admitted_keys()] == [2]
    assert runner.stats()["evictions"] == 1


def test_a_warmup_capture_never_evicts_a_graph_a_call_earned(make_runner):
    runner = make_runner(buckets=BUCKETS, max_bytes=SEG, admission=EAGER_FIRST)
    runner(*inputs(4))
    report = runner.warmup([inputs(2)], progress=False)
    assert list(report.skipped.values()) == ["over_budget"] and report.captured == []
    assert [key.rows for key in runner.admitted_keys()] == [4]
    assert runner.stats()["evictions"] == 0
