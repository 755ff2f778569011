import gc
import weakref

import pytest
import torch

import graphguard.core.entry as entry_module
from graphguard.core.entry import (
    EntryState,
    GraphEntry,
    OwnerCycleError,
    PoolGroup,
    RetiredEntryError,
)
from graphguard.core.keys import GraphKey
from graphguard.core.sim import CALLER_STREAM, SimBackend
from tests.unit.core.conftest import PerfCounter


class Owner:
    """Stands for something a graph reads: weights, a KV pool, a kernel's owner."""


def captured_entry(backend=None, group=None):
    backend = backend or SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend, group)
    x = torch.ones(4)
    entry.capture(lambda t: t * 2, [x])
    return entry


def test_entry_owns_a_stream_and_pool_of_its_own():
    backend = SimBackend()
    a, b = captured_entry(backend), captured_entry(backend)
    assert a.stream != b.stream and a.pool != b.pool


def test_pool_group_members_share_stream_and_pool_until_the_last_retires():
    backend = SimBackend()
    group = PoolGroup("decode")
    a, b = captured_entry(backend, group), captured_entry(backend, group)
    assert a.stream == b.stream and a.pool == b.pool
    pool = a.pool
    a.retire()
    assert group.pool == pool and backend.pool_reserved_bytes(pool) > 0
    b.retire()
    assert group.pool is None and backend.pool_reserved_bytes(pool) == 0


def test_replay_writes_the_same_static_output_tensor():
    entry = captured_entry()
    first = entry.replay()
    entry.static_args[0].fill_(5)
    second = entry.replay()
    assert second is first and torch.equal(first, torch.full((4,), 10.0))


def test_retired_entry_refuses_replay_even_with_outside_references():
    entry = captured_entry()
    outside = entry  # another holder of the entry
    entry.retire()
    with pytest.raises(RetiredEntryError):
        outside.replay()


def test_retire_is_idempotent_and_releases_everything():
    backend = SimBackend()
    entry = captured_entry(backend)
    pool = entry.pool
    assert entry.retire() is True
    assert entry.retire() is False
    assert entry.state is EntryState.RETIRED
    assert entry.graph is None and entry.static_args == [] and entry.static_outputs is None
    assert entry.stream is None and entry.pool is None
    assert backend.pool_reserved_bytes(pool) == 0


def test_retire_waits_on_the_recorded_replay_event_before_reset():
    order = []

    class Recording(SimBackend):
        def wait(self, event):
            order.append("wait")

        def reset(self, graph):
            order.append("reset")
            super().reset(graph)

    entry = captured_entry(Recording())
    entry.replay()
    entry.retire()
    assert order == ["wait", "reset"]


def test_retained_owner_lives_exactly_as_long_as_the_graph_can_replay():
    entry = captured_entry()
    owner = Owner()
    ref = weakref.ref(owner)
    entry.retain(owner)
    del owner
    gc.collect()
    assert ref() is not None
    entry.retire()
    gc.collect()
    assert ref() is None


def test_retained_owner_is_released_when_the_entry_is_collected():
    entry = captured_entry()
    owner = Owner()
    ref = weakref.ref(owner)
    entry.retain(owner)
    del owner, entry
    gc.collect()
    assert ref() is None


def test_owner_that_refers_back_to_the_graph_is_rejected():
    entry = captured_entry()
    owner = Owner()
    owner.graph_entry = entry
    with pytest.raises(OwnerCycleError, match="reference cycle"):
        entry.retain(owner)


def test_owner_closing_over_the_graph_is_rejected():
    entry = captured_entry()
    with pytest.raises(OwnerCycleError):
        entry.retain(lambda: entry.replay())


def test_owner_retained_before_a_failed_capture_is_held_until_retire():
    from graphguard.core.backends import CaptureError

    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    owner = Owner()
    ref = weakref.ref(owner)
    entry.retain(owner)
    del owner
    with pytest.raises(CaptureError):
        entry.capture(lambda t: t * t.sum().item(), [torch.ones(2)])
    gc.collect()
    assert ref() is not None
    entry.retire()
    gc.collect()
    assert ref() is None


def test_resident_bytes_are_the_pools_segments_static_inputs_and_workspace_included():
    backend = SimBackend(segment_bytes=1024, workspace_bytes=3000)
    entry = GraphEntry(GraphKey(("k",)), backend)
    x = torch.ones(1000)  # 4000 bytes of static input, allocated in the pool
    entry.capture(lambda t: t * 2, [x])
    # 4000 input + 3000 workspace + 4000 output = 11000 bytes, in 1 KiB segments
    assert backend.pool_reserved_bytes(entry.pool) == 11264
    assert entry.resident_bytes == 11264
    entry.retire()
    assert backend.reserved_bytes() == 0


def test_a_group_member_is_charged_only_its_growth_of_the_shared_pool():
    backend = SimBackend(segment_bytes=1024, workspace_bytes=3000)
    group = PoolGroup("g")
    first = GraphEntry(GraphKey(("a",)), backend, group)
    first.capture(lambda t: t * 2, [torch.ones(1000)])
    second = GraphEntry(GraphKey(("b",)), backend, group)
    second.capture(lambda t: t + 1, [torch.ones(250)])  # 1000 + 1000 bytes more, no workspace
    pool = backend.pool_reserved_bytes(group.pool)
    assert first.resident_bytes == 11264
    assert second.resident_bytes == pool - 11264 == 2048
    assert first.resident_bytes + second.resident_bytes == pool


def test_an_entry_moves_from_new_to_captured_to_retired():
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    assert entry.state is EntryState.NEW
    entry.capture(lambda t: t * 2, [torch.ones(4)])
    assert entry.state is EntryState.CAPTURED
    entry.retire()
    assert entry.state is EntryState.RETIRED


def test_an_entry_whose_capture_failed_refuses_replay():
    from graphguard.core.backends import CaptureError

    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    with pytest.raises(CaptureError):
        entry.capture(lambda t: t * t.sum().item(), [torch.ones(2)])
    with pytest.raises(RetiredEntryError, match="cannot replay"):
        entry.replay()


def test_a_retired_entry_refuses_new_owners():
    entry = captured_entry()
    entry.retire()
    with pytest.raises(RetiredEntryError, match="retired graph"):
        entry.retain(Owner())


def test_the_owner_cycle_error_names_the_owners_type():
    entry = captured_entry()
    owner = Owner()
    owner.graph_entry = entry
    with pytest.raises(OwnerCycleError, match="^Owner refers back to graph"):
        entry.retain(owner)


def test_an_owner_closing_over_a_variable_not_yet_bound_is_retained():
    entry = captured_entry()

    def retain_before_binding():
        def owner():
            return value

        entry.retain(owner)  # `value` is unbound here: the cell `owner` reads is empty
        value = None
        return owner

    owner = retain_before_binding()
    assert entry.owners == [owner]


def test_a_pool_group_emptied_and_joined_again_charges_its_new_pool_from_zero():
    backend = SimBackend(segment_bytes=1024)
    group = PoolGroup("g")
    first = GraphEntry(GraphKey(("a",)), backend, group)
    first.capture(lambda t: t * 2, [torch.ones(1000)])
    first.retire()  # the last member: the group's pool and stream are released
    again = GraphEntry(GraphKey(("b",)), backend, group)
    again.capture(lambda t: t * 2, [torch.ones(1000)])
    assert again.resident_bytes == backend.pool_reserved_bytes(group.pool) > 0


def test_static_inputs_are_allocated_in_the_entrys_own_pool_and_stream():
    class Recording(SimBackend):
        def __init__(self):
            super().__init__()
            self.allocations = []

        def allocating(self, pool, stream):
            self.allocations.append((pool, stream))
            return super().allocating(pool, stream)

    backend = Recording()
    entry = GraphEntry(GraphKey(("k",)), backend)
    with entry.allocating():
        pass
    assert backend.allocations == [(entry.pool, entry.stream)]


def test_a_staging_buffer_is_a_host_tensor_whatever_the_inputs_device():
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    buffer = entry.add_staging(0, torch.empty(4, device="meta"))
    assert buffer.device.type == "cpu"


def test_host_bytes_add_up_every_staging_buffer():
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    entry.add_staging(0, torch.empty(4))
    entry.add_staging(1, torch.empty(8))
    assert entry.host_bytes == 48 == entry.info().host_bytes


def test_refilling_staging_waits_for_the_last_staged_replay():
    backend = SimBackend()
    entry = captured_entry(backend)
    entry.add_staging(0, entry.static_args[0])
    entry.replay()
    entry.wait_staging()
    assert backend.waits == [(entry.event, CALLER_STREAM)]


def test_staging_before_any_replay_waits_for_nothing():
    backend = SimBackend()
    entry = captured_entry(backend)
    entry.add_staging(0, entry.static_args[0])
    entry.wait_staging()
    assert backend.waits == []


def test_capture_ms_is_the_captures_wall_time_in_milliseconds(monkeypatch):
    monkeypatch.setattr(entry_module, "time", PerfCounter(step_s=0.25))
    assert captured_entry().capture_ms == 250.0


def test_info_rounds_capture_ms_to_the_microsecond(monkeypatch):
    monkeypatch.setattr(entry_module, "time", PerfCounter(step_s=0.0001234))
    assert captured_entry().info().capture_ms == 0.123


def test_a_new_entry_holds_no_bytes_and_is_pending_verification():
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    assert (entry.resident_bytes, entry.verified) == (0, "pending")
    assert entry.info().verified == "pending"


def test_capture_ms_counts_the_warm_ups_too(monkeypatch):
    monkeypatch.setattr(entry_module, "time", PerfCounter(step_s=0.25))
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    entry.static_args = [torch.ones(4)]
    entry.warm_up(lambda t: t * 2)
    entry.warm_up(lambda t: t * 2)
    assert entry.capture_ms == 500.0
    entry.capture(lambda t: t * 2, [torch.ones(4)])
    assert entry.capture_ms == 750.0


def test_a_warm_up_runs_in_the_entrys_live_pool():
    backend = SimBackend()
    entry = GraphEntry(GraphKey(("k",)), backend)
    entry.static_args = [torch.ones(4)]
    entry.warm_up(lambda t: t * 2)
    assert backend.num_warmups == 1
    entry.retire()
    with pytest.raises(RuntimeError, match="not live|outside a live pool"):
        backend.warm_up(lambda t: t * 2, [torch.ones(4)], pool=entry.pool, stream=entry.stream)


def test_the_owner_cycle_error_says_why_it_is_refused():
    entry = captured_entry()
    owner = Owner()
    owner.graph_entry = entry
    with pytest.raises(OwnerCycleError, match="would make a reference cycle that keeps the graph"):
        entry.retain(owner)
