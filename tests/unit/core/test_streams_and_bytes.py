"""Stream, event and byte contracts, on the SimBackend (which keeps streams and events as
identities and charges a simulated workspace inside each pool, as CudaBackend does)."""

from __future__ import annotations

import torch

import graphguard as gg
from graphguard.core.entry import GraphEntry
from graphguard.core.keys import GraphKey
from graphguard.core.sim import CALLER_STREAM, SimBackend, SimStream
from tests.unit.core.conftest import SEG

WORKSPACE = 3 * SEG  # a simulated BLAS workspace, bigger than the graphs themselves
NAIVE = gg.AdmissionConfig(
    min_hits=1, frequency_aware=False, max_recaptures=1 << 30, max_capture_fraction=1.0
)


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_capture_runs_on_the_entrys_own_live_stream():
    backend = SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend)
    assert entry.stream in backend.live_streams and entry.stream is not CALLER_STREAM
    entry.capture(double, [torch.ones(4)])
    entry.retire()
    assert entry.stream is None


def test_a_replay_runs_on_the_callers_stream_and_retire_waits_there():
    backend = SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend)
    entry.capture(double, [torch.ones(4)])
    caller = SimStream(99)
    backend.current = caller
    entry.replay()
    backend.current = CALLER_STREAM  # the retiring thread's stream is another one
    entry.retire()
    assert backend.waits == [(entry.event, caller)]


def test_an_entry_that_never_replayed_waits_for_nothing_at_retire():
    backend = SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend)
    entry.capture(double, [torch.ones(4)])
    entry.retire()
    assert backend.waits == []


def test_retire_destroys_the_entrys_stream_exactly_once():
    backend = SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend)
    stream = entry.stream
    entry.capture(double, [torch.ones(4)])
    assert entry.retire() and not entry.retire()
    assert stream in backend.released_streams and stream not in backend.live_streams


def test_staging_buffers_are_counted_as_host_bytes_and_dropped_at_retire():
    backend = SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend)
    buffer = entry.add_staging(0, torch.ones(256))
    assert entry.host_bytes == 1024 and entry.staging == {0: buffer}
    entry.capture(double, [torch.ones(256)])
    entry.replay()
    assert entry.event.stream is CALLER_STREAM  # a staged replay records its event
    entry.retire()
    assert entry.staging == {}


def test_an_owner_with_a_reference_cycle_of_its_own_is_accepted():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    entry.retain(a)  # the cycle check must not walk a <-> b forever
    assert entry.owners == [a]


def test_every_graph_is_charged_its_workspace_and_the_sum_returns_to_zero():
    backend = SimBackend(workspace_bytes=WORKSPACE)
    runner = gg.GraphRunner(double, backend=backend, admission=NAIVE, max_bytes=1 << 40)
    for rows in (1, 2, 3):
        runner(torch.ones(rows, 4))
    entries = runner._cache.entries()
    assert all(e.resident_bytes >= WORKSPACE for e in entries)
    assert runner.stats()["resident_bytes"] == backend.reserved_bytes()
    runner.close()
    assert backend.reserved_bytes() == 0 and not backend.live_streams


def test_a_capture_evicts_for_its_expected_bytes_before_it_starts():
    seen: list[int] = []

    class Watching(SimBackend):
        def capture(self, fn, args, *, pool, stream, holes=()):
            seen.append(self.reserved_bytes())  # what the device holds as the capture begins
            return super().capture(fn, args, pool=pool, stream=stream, holes=holes)

    backend = Watching(workspace_bytes=WORKSPACE)
    probe = gg.GraphRunner(double, backend=SimBackend(workspace_bytes=WORKSPACE), admission=NAIVE)
    probe(torch.ones(1, 4))
    one = probe.stats()["resident_bytes"]
    probe.close()
    runner = gg.GraphRunner(double, backend=backend, admission=NAIVE, max_bytes=2 * one)
    for rows in (1, 2, 3, 4):
        runner(torch.ones(rows, 4))
    assert runner.stats()["evictions"] == 2
    # with room made first, the device never holds more than the budget during a capture
    assert max(seen) + one <= 2 * one


def test_budget_evictions_are_counted_with_their_cause():
    metrics = gg.GraphMetrics()
    backend = SimBackend()
    runner = gg.GraphRunner(
        double, backend=backend, admission=NAIVE, max_bytes=SEG, metrics=metrics
    )
    runner(torch.ones(1, 4))
    runner(torch.ones(2, 4))
    assert metrics.evictions.labels("budget")._value.get() == 1
    assert metrics.evictions.labels("close")._value.get() == 0
    runner.close()
    assert metrics.evictions.labels("close")._value.get() == 1
