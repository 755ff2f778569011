"""The runtime's contracts on a real CUDA device (run through tools/gpu-check)."""

import gc
import threading
import time
import weakref

import pytest
import torch

import graphguard as gg
from graphguard.core.backends import CudaBackend
from graphguard.core.entry import GraphEntry
from graphguard.core.keys import GraphKey

pytestmark = pytest.mark.gpu
EAGER_FIRST = gg.AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)


def mlp(x, w):
    return torch.tanh(x @ w).sum(-1), torch.relu(x @ w)


def no_stream_capturing():
    return not torch.cuda.is_current_stream_capturing()


def test_forty_entries_alive_with_forty_distinct_capture_streams(device):
    pytest.importorskip("cuda.bindings", reason="owned streams need cuda.bindings")
    w = torch.randn(64, 64, device=device)
    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST, max_bytes=1 << 34)
    for rows in range(1, 41):
        runner(torch.randn(rows, 64, device=device), w)
    entries = runner._cache.entries()
    assert len(entries) == 40
    assert len({e.stream.cuda_stream for e in entries}) == 40
    assert len({tuple(e.pool) for e in entries}) == 40
    runner.close()


def test_replays_stay_bitwise_equal_to_eager_across_evictions(device):
    w = torch.randn(256, 256, device=device)
    naive = gg.AdmissionConfig(
        min_hits=1, frequency_aware=False, max_recaptures=1 << 30, max_capture_fraction=1.0
    )
    runner = gg.GraphRunner(mlp, admission=naive, max_bytes=1 << 40)
    runner(torch.randn(16, 256, device=device), w)
    largest = runner.stats()["resident_bytes"]
    runner.close()
    runner = gg.GraphRunner(mlp, admission=naive, max_bytes=3 * largest)
    for i in range(200):
        rows = 8 if i % 2 == 0 else 9 + (i % 7)  # 8 survives while the others churn
        x = torch.randn(rows, 256, device=device)  # new content on every call
        got, ref = runner(x, w), mlp(x, w)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    survivor = next(e for e in runner._cache.entries() if e.key.args[0].shape[0] == 8)
    stats = runner.stats()
    assert survivor.replays == 100, stats
    assert stats["evictions"] > 0 and stats["fallbacks"] == {}, stats
    runner.close()


def pool_bytes_in_snapshot(pool):
    return sum(
        s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", ())) == tuple(pool)
    )


def test_resident_bytes_come_from_the_pools_reserved_segments(device):
    w = torch.randn(1024, 1024, device=device)
    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST)
    runner(torch.randn(512, 1024, device=device), w)
    (entry,) = runner._cache.entries()
    pool = pool_bytes_in_snapshot(entry.pool)
    assert pool > 0
    # the static inputs (x and w) live in the pool too: its segments are the whole charge
    assert pool >= 512 * 1024 * 4 + 1024 * 1024 * 4
    assert entry.resident_bytes == pool
    runner.close()


def test_eviction_returns_the_pools_reserved_bytes(device):
    w = torch.randn(1024, 1024, device=device)
    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST)
    runner(torch.randn(8, 1024, device=device), w)  # the caller's own workspace exists from here
    runner.invalidate()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    runner(torch.randn(4096, 1024, device=device), w)
    (entry,) = runner._cache.entries()
    pool = entry.pool
    assert pool_bytes_in_snapshot(pool) >= 4096 * 1024 * 4
    runner.invalidate()  # retire + trim
    gc.collect()
    assert pool_bytes_in_snapshot(pool) == 0
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(device) == before
    runner.close()


def test_budget_evicts_by_reserved_pool_bytes(device):
    w = torch.randn(1024, 1024, device=device)
    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST, max_bytes=1 << 40)
    runner(torch.randn(1024, 1024, device=device), w)
    one = runner.stats()["resident_bytes"]
    runner.close()
    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST, max_bytes=2 * one + one // 2)
    for rows in (1024, 1023, 1022):
        runner(torch.randn(rows, 1024, device=device), w)
        entries = runner._cache.entries()
        for e in entries:
            assert e.resident_bytes == pool_bytes_in_snapshot(e.pool)
        assert sum(e.resident_bytes for e in entries) <= runner.stats()["max_bytes"]

    assert runner.stats()["evictions"] == 1
    runner.close()


def test_one_mib_budget_runs_everything_eagerly_and_correctly(device):
    w = torch.randn(64, 64, device=device)
    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST, max_bytes=1 << 20)
    for rows in (1, 2, 3, 1, 2, 3):
        x = torch.randn(rows, 64, device=device)
        assert torch.equal(runner(x, w)[1], mlp(x, w)[1])
    assert runner.stats()["entries"] == 0
    assert set(runner.stats()["fallbacks"]) == {"over_budget"}
    runner.close()


def test_failed_capture_leaves_no_stream_capturing_and_later_captures_work(device):
    def syncing(x):
        return x * x.sum().item()

    runner = gg.GraphRunner(syncing, admission=EAGER_FIRST)
    x = torch.randn(4, device=device)
    assert torch.equal(runner(x), syncing(x))
    assert runner.stats()["fallbacks"] == {"capture_failed": 1}
    assert no_stream_capturing()
    torch.randn(3, device=device)  # the default generator left capture mode
    # The same backend captures again (the failed entry's stream was destroyed).
    good = gg.GraphRunner(lambda x: x * 2, admission=EAGER_FIRST, backend=runner.backend)
    for rows in (1, 2, 3):
        y = torch.randn(rows, device=device)
        assert torch.equal(good(y), y * 2)
    assert good.stats()["captures"] == 3
    runner.close()
    good.close()


def test_retire_from_another_thread_waits_for_the_inflight_replay(device):
    cycles = 200_000_000  # ~0.1 s or more of GPU spin

    def slow(x):
        torch.cuda._sleep(cycles)
        return x * 2

    runner = gg.GraphRunner(
        slow, admission=EAGER_FIRST, verify="off", capture=gg.CaptureConfig(stage_host_inputs=True)
    )
    host = torch.arange(4.0)
    runner(host)  # capture (host input staged through a pinned buffer)
    (entry,) = runner._cache.entries()
    staging_ref = weakref.ref(entry.staging[0])
    owner = type("Owner", (), {})()
    owner_ref = weakref.ref(owner)
    entry.retain(owner)
    del owner
    entry.replay(lambda: entry.static_args[0].copy_(entry.staging[0], non_blocking=True))
    event = entry.event
    assert not event.query()  # the replay is still running
    done = threading.Event()

    def retire():
        entry.retire()
        done.set()

    worker = threading.Thread(target=retire)
    worker.start()
    time.sleep(0.01)
    assert staging_ref() is not None  # retire is waiting on the replay's event
    worker.join(timeout=30)
    assert done.is_set() and event.query()
    gc.collect()
    assert staging_ref() is None and owner_ref() is None
    runner.close()


def test_retained_owners_are_released_exactly_when_the_graph_is(device):
    backend = CudaBackend(device)
    entry = GraphEntry(GraphKey(("k",)), backend)
    weights = torch.randn(16, device=device)
    ref = weakref.ref(weights)
    entry.retain(weights)
    entry.capture(lambda x: x * 3, [torch.ones(16, device=device)])
    del weights
    gc.collect()
    assert ref() is not None
    entry.replay()
    entry.retire()
    gc.collect()
    assert ref() is None


def test_owner_held_through_a_failed_capture_until_cleanup(device):
    backend = CudaBackend(device)
    entry = GraphEntry(GraphKey(("k",)), backend)
    weights = torch.randn(16, device=device)
    ref = weakref.ref(weights)
    entry.retain(weights)
    del weights
    with pytest.raises(gg.CaptureError):
        entry.capture(lambda x: x * x.sum().item(), [torch.ones(16, device=device)])
    gc.collect()
    assert ref() is not None and no_stream_capturing()
    entry.retire()
    gc.collect()
    assert ref() is None


def test_input_on_another_device_falls_back(device):
    runner = gg.GraphRunner(lambda x: x + 1, admission=EAGER_FIRST)
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    assert runner.stats()["fallbacks"] == {"device_mismatch": 1}
    runner.close()


def test_replay_is_ordered_after_the_callers_stream(device):
    runner = gg.GraphRunner(lambda x: x * 2, admission=EAGER_FIRST)
    x = torch.ones(1 << 20, device=device)
    runner(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.fill_(5.0)  # written late on the caller's stream
        out = runner(x)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 10.0))
    runner.close()


def test_kill_switch_mid_run_falls_back_at_the_next_call(device, monkeypatch):
    runner = gg.GraphRunner(lambda x: x * 2, admission=EAGER_FIRST)
    x = torch.ones(4, device=device)
    runner(x)
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    runner(x)
    assert runner.stats()["fallbacks"] == {"kill_switch": 1}
    runner.close()
