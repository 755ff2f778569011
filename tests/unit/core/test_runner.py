import logging

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import graphguard as gg
from graphguard.core.reasons import FallbackReason
from tests.unit.core.conftest import SEG, inputs, mlp_step
from tests.unit.core.stand_ins import counting, jitter

MiB = 1 << 20


def test_replay_returns_the_eager_result(make_runner):
    runner = make_runner(buckets=gg.Buckets(batch=[1, 2, 4, 8]))
    for rows in (1, 3, 3, 8):
        x, pos = inputs(rows, seed=rows)
        got, ref = runner(x, pos), mlp_step(x, pos)
        assert torch.allclose(got[0], ref[0]) and torch.allclose(got[1], ref[1])
        assert got[1].shape == (rows, 8)
    assert runner.stats()["replays"] == 4 and runner.stats()["captures"] == 3


def test_padded_rows_are_filled_with_the_declared_pad_value(make_runner):
    seen = []

    def step(ids):
        seen.append(ids.clone())
        return ids * 2

    runner = make_runner(step, buckets=gg.Buckets(batch=[4], pad_value=-7))
    out = runner(torch.tensor([1, 2]))
    assert torch.equal(out, torch.tensor([2, 4]))
    assert torch.equal(seen[-1], torch.tensor([1, 2, -7, -7]))


def test_shape_above_the_largest_bucket_falls_back_unbucketed(make_runner):
    runner = make_runner(buckets=gg.Buckets(batch=[1, 2]))
    x, pos = inputs(3)
    assert torch.allclose(runner(x, pos)[0], mlp_step(x, pos)[0])
    assert runner.stats()["fallbacks"] == {"unbucketed_shape": 1}


def test_kill_switch_is_read_on_every_call(make_runner, monkeypatch):
    runner = make_runner()
    x, pos = inputs(2)
    runner(x, pos)
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    runner(x, pos)
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "0")
    runner(x, pos)
    stats = runner.stats()
    assert stats["fallbacks"] == {"kill_switch": 1} and stats["replays"] == 2


def test_kill_switch_beats_a_disabled_runner(make_runner, monkeypatch):
    runner = make_runner(enabled=False)
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    runner(*inputs(1))
    assert runner.stats()["fallbacks"] == {"kill_switch": 1}


def test_disabled_runner_runs_eagerly(make_runner):
    runner = make_runner(enabled=False)
    runner(*inputs(1))
    assert runner.stats()["fallbacks"] == {"disabled": 1}


def test_auto_backend_without_cuda_falls_back_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    runner = gg.GraphRunner(mlp_step, backend="auto")
    runner(*inputs(1))
    assert runner.stats()["fallbacks"] == {"no_cuda": 1}


def test_cuda_backend_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        gg.GraphRunner(mlp_step, backend="cuda")


def test_input_on_another_device_falls_back(make_runner):
    runner = make_runner()
    x = torch.randn(2, 8, device="meta")
    out = runner(x, torch.randn(2, 8, device="meta"))
    assert out[0].device.type == "meta"
    assert runner.stats()["fallbacks"] == {"device_mismatch": 1}


def host_sync_step(x, pos):
    return x * pos.sum().item()


def test_capture_failure_returns_eager_and_quarantines_with_backoff(make_runner, clock):
    runner = make_runner(host_sync_step)
    x, pos = inputs(2)
    assert torch.allclose(runner(x, pos), host_sync_step(x, pos))
    assert runner(x, pos) is not None
    stats = runner.stats()
    assert stats["fallbacks"] == {"capture_failed": 1, "quarantined": 1}
    assert stats["quarantined_keys"] == 1 and stats["entries"] == 0
    clock.advance(1.5)  # past the first backoff: one more attempt, then twice as long
    runner(x, pos)
    clock.advance(1.5)
    runner(x, pos)
    assert runner.stats()["fallbacks"] == {"capture_failed": 2, "quarantined": 2}


def test_strict_mode_reraises_the_capture_error(make_runner):
    runner = make_runner(host_sync_step, strict=True)
    with pytest.raises(gg.CaptureError, match="not permitted when stream is capturing"):
        runner(*inputs(2))


def test_later_captures_work_after_a_failed_one(make_runner):
    flaky = {"sync": True}

    def step(x, pos):
        if flaky["sync"]:
            x = x * pos.sum().item()
        return x + pos

    runner = make_runner(step)
    runner(*inputs(2))
    flaky["sync"] = False
    runner(*inputs(3))
    assert runner.stats()["captures"] == 1


def drifting_step_factory():
    return counting()  # each execution adds one more: eager and replay disagree


def test_parity_mismatch_at_admission_retires_and_quarantines(make_runner):
    runner = make_runner(drifting_step_factory())
    runner(torch.zeros(2))
    stats = runner.stats()
    assert stats["fallbacks"] == {"parity_mismatch": 1} and stats["entries"] == 0
    assert stats["parity_mismatches"] == 1 and stats["quarantined_keys"] == 1


def test_verify_off_admits_without_comparing(make_runner):
    runner = make_runner(drifting_step_factory(), verify="off")
    runner(torch.zeros(2))
    assert runner.stats()["entries"] == 1


def test_allclose_needs_explicit_tolerances(make_runner):
    with pytest.raises(ValueError, match="rtol and atol"):
        make_runner(verify="allclose")


def test_sampled_reverification_quarantines_on_drift(make_runner):
    state = {"drift": 0.0}

    def step(x):
        return x + state["drift"]

    runner = make_runner(step, reverify_every=2)
    runner(torch.zeros(2))
    runner(torch.zeros(2))  # replay 2 (the admission replay was 1): re-verified, equal
    assert runner.stats()["entries"] == 1
    state["drift"] = 0.5  # replays now disagree with eager only through the counter below
    calls = {"n": 0}

    def drifting(x):
        calls["n"] += 1
        return x + calls["n"]

    runner.kind.fn = drifting
    runner(torch.zeros(2))
    out = runner(torch.zeros(2))  # replay 4: re-verified, differs, evicted, eager returned
    stats = runner.stats()
    assert stats["entries"] == 0 and stats["quarantined_keys"] == 1
    assert stats["fallbacks"] == {"parity_mismatch": 1} and stats["parity_mismatches"] == 1
    assert torch.equal(out, torch.full((2,), float(calls["n"])))


def test_over_budget_candidate_is_retired_and_the_key_falls_back(make_runner, caplog):
    runner = make_runner(max_bytes=1 * MiB)
    x, pos = inputs(2)
    with caplog.at_level(logging.INFO, logger="graphguard"):
        for _ in range(3):
            assert torch.allclose(runner(x, pos)[1], mlp_step(x, pos)[1])
    stats = runner.stats()
    assert stats["entries"] == 0 and stats["resident_bytes"] == 0
    assert stats["fallbacks"] == {"over_budget": 3}
    assert runner.backend.num_captures == 1  # the size is remembered: no capture per call
    assert any("over_budget" in r.message for r in caplog.records)


def test_budget_holds_after_every_call_and_lru_is_evicted(make_runner):
    runner = make_runner(
        max_bytes=2 * SEG + 4096, admission=gg.AdmissionConfig(min_hits=1, frequency_aware=False)
    )
    for width in (4, 5, 6, 4, 7):
        runner(*inputs(2, width=width))
        assert runner.stats()["resident_bytes"] <= runner.stats()["max_bytes"]
    keys = [k.args[0].shape[1] for k in runner.admitted_keys()]
    assert keys == [4, 7]


def test_close_is_idempotent_and_later_calls_run_eagerly(make_runner):
    runner = make_runner()
    runner(*inputs(2))
    runner.close()
    runner.close()
    x, pos = inputs(2)
    assert torch.allclose(runner(x, pos)[0], mlp_step(x, pos)[0])
    assert runner.stats()["entries"] == 0 and runner.stats()["fallbacks"] == {"closed": 1}


def test_retained_owners_are_kept_by_every_graph_of_the_runner(make_runner):
    import gc
    import weakref

    class Weights:
        pass

    weights = Weights()
    ref = weakref.ref(weights)
    runner = make_runner(retain=[weights], buckets=gg.Buckets(batch=[2, 4]))
    runner(*inputs(2))
    runner(*inputs(4))
    entries = runner._cache.entries()
    assert len(entries) == 2 and all(any(o is weights for o in e.owners) for e in entries)
    runner.kind.owners.clear()  # from here only the graphs hold it
    del weights
    gc.collect()
    assert ref() is not None  # kept alive by the graphs
    runner._cache.evict(entries[0].key, "budget")
    gc.collect()
    assert ref() is not None  # the other graph still keeps it
    runner.invalidate()
    gc.collect()
    assert ref() is None  # released with the last graph


def test_views_of_static_outputs_are_overwritten_by_the_next_replay(make_runner):
    runner = make_runner(lambda x: x * 2, copy_outputs=False)
    first = runner(torch.ones(2))
    runner(torch.full((2,), 3.0))
    assert torch.equal(first, torch.full((2,), 6.0))


def test_metrics_count_captures_replays_and_fallbacks(make_runner):
    metrics = gg.GraphMetrics()
    runner = make_runner(metrics=metrics, buckets=gg.Buckets(batch=[2]))
    runner(*inputs(2))
    runner(*inputs(1))
    runner(*inputs(3))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    assert samples[("graphguard_captures_total", (("outcome", "admitted"),))] == 1
    assert samples[("graphguard_replays_total", ())] == 2
    assert samples[("graphguard_fallbacks_total", (("reason", "unbucketed_shape"),))] == 1
    assert samples[("graphguard_graph_entries", ())] == 1
    assert samples[("graphguard_graph_resident_bytes", ())] == runner.stats()["resident_bytes"]


def test_the_call_metric_is_every_runners_replays_plus_fallbacks(make_runner):
    metrics = gg.GraphMetrics()
    graphs = make_runner(metrics=metrics, buckets=gg.Buckets(batch=[2]))
    eager = make_runner(metrics=metrics, enabled=False)
    for _ in range(3):
        graphs(*inputs(2))  # a capture that answers, then two replays
    graphs(*inputs(3))  # unbucketed_shape
    eager(*inputs(2))  # disabled
    assert metrics.registry.get_sample_value("graphguard_calls_total") == 5
    assert sum(r.stats()["calls"] for r in (graphs, eager)) == 5


def test_one_log_line_per_capture_with_key_bytes_and_ms(make_runner, caplog):
    runner = make_runner()
    with caplog.at_level(logging.INFO, logger="graphguard"):
        runner(*inputs(2))
    lines = [r.message for r in caplog.records if "graphguard capture" in r.message]
    assert len(lines) == 1 and "bytes=" in lines[0] and "ms=" in lines[0]


def test_every_fallback_has_exactly_one_reason(make_runner, monkeypatch):
    runner = make_runner(buckets=gg.Buckets(batch=[2]), max_bytes=1 * MiB)
    runner(*inputs(2))  # over_budget
    runner(*inputs(5))  # unbucketed_shape
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    runner(*inputs(2))  # kill_switch
    stats = runner.stats()
    assert sum(stats["fallbacks"].values()) == 3
    assert set(stats["fallbacks"]) <= {r.value for r in FallbackReason}


def test_an_exception_escaping_capture_still_retires_the_candidate(make_runner):
    state = {"interrupt": True}

    def step(x):
        if state["interrupt"]:
            raise KeyboardInterrupt  # not an Exception: capture must not swallow it
        return x * 2

    runner = make_runner(step)
    with pytest.raises(KeyboardInterrupt):
        runner(torch.ones(2))
    backend = runner.backend
    assert backend._pool_bytes == {} and len(backend.released_streams) == 1


def test_a_tensor_argument_without_a_pad_value_falls_back_unsupported(make_runner):
    runner = make_runner(buckets=gg.Buckets(batch=[4], pad_value=(0,)))
    x, pos = inputs(2)
    assert torch.allclose(runner(x, pos)[0], mlp_step(x, pos)[0])
    assert runner.stats()["fallbacks"] == {"unsupported_input": 1}


def test_every_call_is_one_replay_or_one_fallback(make_runner, monkeypatch, clock):
    calls = {"n": 0}

    def step(x):
        calls["n"] += 1
        return x + (calls["n"] if x.shape[0] == 3 else 0)  # rows=3 never matches eager

    runner = make_runner(step, buckets=gg.Buckets(batch=[2, 4]), reverify_every=2)
    for rows in (1, 2, 2, 2, 3, 3, 5, 9):
        runner(torch.ones(rows))
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    runner(torch.ones(2))
    stats = runner.stats()
    assert stats["calls"] == 9
    assert stats["calls"] == stats["replays"] + sum(stats["fallbacks"].values())


def test_quarantined_keys_gauge_adds_up_across_runners_sharing_metrics(make_runner):
    metrics = gg.GraphMetrics()
    first = make_runner(host_sync_step, metrics=metrics)
    second = make_runner(host_sync_step, metrics=metrics)
    first(*inputs(2))
    first(*inputs(3))
    second(*inputs(2))
    assert metrics.quarantined._value.get() == 3


def test_zero_windows_are_rejected():
    with pytest.raises(ValueError, match="must be > 0"):
        gg.AdmissionConfig(capture_window_s=0)
    with pytest.raises(ValueError, match="max_recaptures"):
        gg.AdmissionConfig(max_recaptures=0)


def test_a_graph_admitted_without_a_parity_check_reports_parity_off(make_runner):
    # docs/export.md: parity is the check the graph passed, `exact`, `allclose` or `off`
    runner = make_runner(verify="off")
    runner(*inputs(2))
    assert [entry.verified for entry in runner.entries()] == ["off"]


def test_exact_parity_rejects_a_step_whose_eager_runs_differ(make_runner):
    runner = make_runner(jitter([0.0, 0.0, 0.25]))  # record run, simulated capture, replay
    runner(torch.ones(4))
    assert runner.stats()["parity_mismatches"] == 1


def test_spread_parity_admits_a_graph_within_eagers_own_spread_and_reports_both(make_runner):
    # record run +0, spread run +0.25, the simulated capture +0, the first replay +0.25
    runner = make_runner(jitter([0.0, 0.25]), verify="spread")
    runner(torch.ones(4))
    (info,) = runner.entries()
    assert runner.stats()["captures"] == 1 and info.verified == "spread"
    assert (info.eager_spread, info.graph_error) == (0.25, 0.25)


def test_spread_parity_rejects_a_graph_farther_from_eager_than_eager_from_itself(make_runner):
    runner = make_runner(jitter([0.0, 0.25, 0.0, 1.0]), verify="spread")  # replay: +1.0
    runner(torch.ones(4))
    assert runner.stats()["parity_mismatches"] == 1 and runner.entries() == []
