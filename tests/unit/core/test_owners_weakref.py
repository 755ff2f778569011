"""Lifetimes of what a graph owns (SimBackend): its pool and the owners retained through it.

Owners and pools live exactly as long as their graph can replay: through an export, until the
entry is retired (evicted, invalidated, closed) or collected, and still while a failed capture
or instantiation waits for cleanup. An owner that refers back to its graph is rejected.
"""

from __future__ import annotations

import gc
import weakref

import pytest

import graphguard as gg
from graphguard.core.backends import CaptureError
from graphguard.core.entry import GraphEntry
from graphguard.core.export import export_manifest
from graphguard.core.inventory import read_inventory
from graphguard.core.keys import GraphKey
from graphguard.core.sim import SimBackend
from tests.unit.core.conftest import SEG, inputs, mlp_step


class Owner:
    """Something a graph reads that nobody else keeps alive (weights, a KV pool)."""

    def __init__(self, payload: object = None):
        self.payload = payload


class InstantiateFails(SimBackend):
    """A backend whose capture records the graph and then fails to instantiate it."""

    def capture(self, fn, args, *, pool, stream, holes=()):
        super().capture(fn, args, pool=pool, stream=stream, holes=holes)
        raise CaptureError("cudaErrorInvalidValue during instantiate")


def one_admitted_entry(make_runner, **kwargs) -> tuple[gg.GraphRunner, GraphEntry]:
    runner = make_runner(**kwargs)
    runner(*inputs(4))
    (entry,) = runner._cache.entries()
    return runner, entry


def retain_fresh_owner(entry: GraphEntry) -> weakref.ref:
    owner = Owner()
    entry.retain(owner)
    return weakref.ref(owner)


def test_owner_stays_alive_while_its_graph_is_admitted(make_runner):
    runner, entry = one_admitted_entry(make_runner)
    ref = retain_fresh_owner(entry)
    for _ in range(3):
        runner(*inputs(4))
    gc.collect()
    assert ref() is not None


def test_owner_stays_alive_through_export(make_runner, tmp_path):
    runner, entry = one_admitted_entry(make_runner)
    ref = retain_fresh_owner(entry)
    alive_while_reading = []

    def reader(graph, backend):
        gc.collect()
        alive_while_reading.append(ref() is not None and graph is entry.graph)
        return read_inventory(graph, backend)

    export_manifest(runner, tmp_path / "m.json", read=reader)
    gc.collect()
    assert alive_while_reading == [True]
    assert ref() is not None and not entry.is_retired


def test_pool_stays_reserved_through_export_and_is_released_on_retire(make_runner, tmp_path):
    runner, entry = one_admitted_entry(make_runner)
    pool, backend = entry.pool, entry.backend
    reserved = backend.pool_reserved_bytes(pool)
    runner.export(tmp_path / "m.json")
    assert reserved >= SEG and backend.pool_reserved_bytes(pool) == reserved
    runner.invalidate()
    assert backend.pool_reserved_bytes(pool) == 0


def test_owner_is_released_when_its_graph_is_evicted_for_budget(make_runner):
    only_lru = gg.AdmissionConfig(min_hits=1, frequency_aware=False)
    runner, entry = one_admitted_entry(make_runner, max_bytes=SEG + 4096, admission=only_lru)
    ref = retain_fresh_owner(entry)
    runner(*inputs(3, width=16))  # another key; the budget holds one graph
    assert entry.is_retired and ref() is None


def test_owner_is_released_when_the_runner_invalidates_its_graphs(make_runner):
    runner, entry = one_admitted_entry(make_runner)
    ref = retain_fresh_owner(entry)
    runner.invalidate()
    assert ref() is None  # no collection needed: retire drops it


def test_owner_is_released_when_the_runner_is_closed(make_runner):
    runner, entry = one_admitted_entry(make_runner)
    ref = retain_fresh_owner(entry)
    runner.close()
    assert ref() is None


def test_owner_is_released_when_an_unretired_entry_is_collected():
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    entry.capture(mlp_step, list(inputs(2)))
    ref = retain_fresh_owner(entry)
    del entry
    gc.collect()
    assert ref() is None


def test_owner_and_runner_are_collected_after_an_export(make_runner, tmp_path):
    owner = Owner()
    owner_ref = weakref.ref(owner)
    runner = gg.GraphRunner(mlp_step, backend="sim", admission=gg.AdmissionConfig(min_hits=1))
    runner(*inputs(4))
    runner._cache.entries()[0].retain(owner)
    runner.export(tmp_path / "m.json")
    runner_ref = weakref.ref(runner)
    del runner, owner
    gc.collect()
    assert runner_ref() is None and owner_ref() is None


def test_owner_is_held_when_capture_fails_until_the_entry_is_retired():
    entry = GraphEntry(GraphKey(("k",)), SimBackend())
    ref = retain_fresh_owner(entry)
    x, pos = inputs(2)
    with pytest.raises(CaptureError):
        entry.capture(lambda a, b: a * float(b.sum().item()), [x, pos])
    gc.collect()
    assert ref() is not None
    entry.retire()
    assert ref() is None


def test_owner_is_held_when_instantiation_fails_until_cleanup():
    entry = GraphEntry(GraphKey(("k",)), InstantiateFails())
    ref = retain_fresh_owner(entry)
    with pytest.raises(CaptureError, match="instantiate"):
        entry.capture(mlp_step, list(inputs(2)))
    gc.collect()
    assert ref() is not None
    entry.retire()
    assert ref() is None


def test_runner_releases_the_pool_of_a_failed_instantiation(make_runner):
    backend = InstantiateFails()
    runner = make_runner(backend=backend)
    runner(*inputs(2))  # answered eagerly
    assert runner.stats()["capture_failures"] == 1 and runner.admitted_keys() == []
    assert backend._pool_bytes == {}  # the partial graph's pool went with its cleanup


def test_owner_referring_to_its_graph_is_rejected(make_runner):
    _, entry = one_admitted_entry(make_runner)
    with pytest.raises(gg.OwnerCycleError):
        entry.retain(Owner(payload={"graph": entry.graph}))
    assert all(not isinstance(o, Owner) for o in entry.owners)


def test_owner_referring_to_its_entry_is_rejected(make_runner):
    _, entry = one_admitted_entry(make_runner)
    with pytest.raises(gg.OwnerCycleError):
        entry.retain(Owner(payload=[entry]))
