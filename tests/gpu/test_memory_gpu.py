"""The byte budget by the allocator's own count: memory_reserved(), not the runner's figures.

Each test takes the device's reserved bytes before the graphs exist, lets the runner charge
what it charges, and checks the allocator agrees: growth within the charge (+ one 2 MiB small
segment of slack), and back to the baseline once the graphs are gone.

NOTE: a capture clears every cached cuBLAS workspace (PyTorch has no clear for one stream), so
a workspace some earlier test left cached for another stream would be freed by the first
capture and read as the graphs holding 32 MiB less than their charge (run 34). The baseline
is therefore taken with exactly the caller's own workspace cached.
"""

from __future__ import annotations

import gc

import pytest
import torch

import graphguard as gg
from graphguard.segmented import SegmentedRunner, Stage

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SLACK = 2 * MiB
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
NAIVE = gg.AdmissionConfig(
    min_hits=1, frequency_aware=False, max_recaptures=1 << 30, max_capture_fraction=1.0
)


def settled() -> int:
    """Reserved bytes once nothing is cached: what the device really holds."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@pytest.fixture
def mlp(device):
    w = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)

    def step(x):
        return torch.relu(x @ w) @ w

    inputs = {b: torch.randn(b, 2048, device=device, dtype=torch.bfloat16) for b in BUCKETS}
    torch._C._cuda_clearCublasWorkspaces()  # none left cached by earlier tests' streams
    for x in inputs.values():
        step(x)  # the caller's own cuBLAS workspace exists before the baseline
    return step, inputs


def test_eight_buckets_grow_reserved_by_no_more_than_their_charge(mlp):
    step, inputs = mlp
    baseline = settled()
    runner = gg.GraphRunner(step, buckets=gg.Buckets(batch=BUCKETS), admission=NAIVE)
    for x in inputs.values():
        assert torch.equal(runner(x), step(x))
        charged = runner.stats()["resident_bytes"]
        assert settled() - baseline <= charged + SLACK, runner.stats()
    assert runner.stats()["entries"] == len(BUCKETS)
    charged = runner.stats()["resident_bytes"]
    # the charge is the truth, not an upper bound: it holds every pool's workspace
    assert settled() - baseline >= charged - SLACK
    runner.close()
    assert abs(settled() - baseline) <= SLACK


def test_a_capture_cancelled_after_its_warm_ups_gives_every_byte_back(mlp):
    # A warm-up is a unit of its own: cancelled before the capture unit, nothing may stay
    # behind, the warm-ups' cuBLAS workspace (32 MiB, keyed by the candidate's stream) included.
    step, inputs = mlp
    baseline = settled()
    runner = gg.GraphRunner(
        step,
        buckets=gg.Buckets(batch=BUCKETS),
        admission=NAIVE,
        capture=gg.CaptureConfig(background=True),
    )
    x = inputs[8]
    assert torch.equal(runner(x), step(x))  # earns the key, answered eagerly
    for _ in range(runner.backend.num_warmup):
        runner.advance_capture()  # static inputs and the warm-ups; the capture is next
    assert runner.capture_in_flight is not None and runner.stats()["entries"] == 0
    pool = runner._job.candidate.pool
    assert runner.backend.pool_reserved_bytes(pool) >= 32 * MiB  # the warm-ups' workspace
    runner.close()  # cancels it
    assert runner.stats()["captures_cancelled"] == 1
    settled()
    assert runner.backend.pool_reserved_bytes(pool) == 0  # not one segment of its pool is left
    # and nothing anywhere else: the device holds no more than before (less, even: the
    # warm-ups' clear of every cached workspace dropped caches that were not the runner's)
    assert settled() - baseline <= SLACK


def test_churn_of_eight_shapes_never_holds_more_than_the_budget(mlp):
    step, inputs = mlp
    probe = gg.GraphRunner(step, admission=NAIVE)
    probe(inputs[128])
    one = probe.stats()["resident_bytes"]
    probe.close()
    step(inputs[128])  # the caller's workspace, which the probe's capture cleared, cached again
    baseline = settled()
    torch.cuda.reset_peak_memory_stats()
    budget = 3 * one + one // 2
    runner = gg.GraphRunner(step, max_bytes=budget, admission=NAIVE)
    for i in range(48):
        x = inputs[BUCKETS[i % len(BUCKETS)]]
        assert torch.equal(runner(x), step(x))
        # the allocator's own peak, so "at every instant", not only between calls
        assert torch.cuda.max_memory_reserved() - baseline <= budget + SLACK, (i, runner.stats())
    stats = runner.stats()
    assert stats["evictions"] > 0 and stats["entries"] == 3, stats
    runner.close()
    assert abs(settled() - baseline) <= SLACK


def test_evicting_one_entry_gives_its_bytes_back(mlp):
    step, inputs = mlp
    runner = gg.GraphRunner(step, admission=NAIVE)
    runner(inputs[8])
    with_one = settled()
    runner(inputs[16])
    (first, second) = runner._cache.entries()
    assert settled() - with_one == pytest.approx(second.resident_bytes, abs=SLACK)
    runner._cache.evict(second.key, "budget")
    assert abs(settled() - with_one) <= SLACK
    runner.close()


def test_streams_are_destroyed_with_their_entries(mlp):
    pytest.importorskip("cuda.bindings", reason="owned streams need cuda.bindings")
    step, inputs = mlp
    runner = gg.GraphRunner(step, admission=NAIVE)
    runner(inputs[4])
    (entry,) = runner._cache.entries()
    stream = entry.stream
    assert getattr(stream, "owned_handle", None) is not None
    runner.close()
    assert stream.owned_handle is None  # cudaStreamDestroy ran; nothing is kept for reuse


def test_segment_groups_grow_reserved_by_their_charge_and_give_it_back(device):
    w = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    stages = [
        Stage("proj", lambda x: (torch.relu(x @ w),)),
        Stage("hole", lambda context, x: (x * 2,), eager=True),
        Stage("mix", lambda x: (x @ w,)),
    ]
    inputs = [torch.randn(rows, 1024, device=device, dtype=torch.bfloat16) for rows in (3, 5)]
    for x in inputs:
        (x @ w).sum()
    baseline = settled()
    runner = SegmentedRunner(stages, admission=NAIVE, max_bytes=1 << 40)
    for x in inputs:
        (out,) = runner((x,))
        assert torch.equal(out, runner.eager((x,))[0])
    charged = runner.stats()["resident_bytes"]
    assert runner.stats()["groups"] == 2
    assert abs(settled() - baseline - charged) <= SLACK, runner.stats()
    runner.close()
    assert abs(settled() - baseline) <= SLACK
