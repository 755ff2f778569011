import logging

import pytest
import torch

from graphguard.core.cache import GraphCache
from graphguard.core.entry import GraphEntry
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import EvictionCause
from graphguard.core.sim import SimBackend
from tests.unit.core.conftest import inputs

SEG = 1024


def entry_of(name: str, backend: SimBackend, numel: int = 256) -> GraphEntry:
    entry = GraphEntry(GraphKey((name,)), backend)
    entry.capture(lambda: torch.ones(numel), [])  # numel * 4 bytes of pool, no static inputs
    return entry


def test_admit_evicts_least_recently_used_to_stay_within_budget():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=3 * SEG)
    a, b, c, d = (entry_of(n, backend) for n in "abcd")
    for e in (a, b, c):
        assert cache.admit(e)
    cache.release(cache.acquire(a.key))  # touching a makes b the least recently used
    assert cache.admit(d)
    assert b.is_retired and not a.is_retired
    assert cache.resident_bytes == 3 * SEG


def test_eviction_skips_pinned_entries():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=2 * SEG)
    a, b, c = (entry_of(n, backend) for n in "abc")
    cache.admit(a)
    cache.admit(b)
    pinned = cache.acquire(a.key)
    assert cache.admit(c)
    cache.release(pinned)
    assert not a.is_retired and b.is_retired


def test_bytes_reserved_for_a_capture_in_flight_make_eviction_come_sooner():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=4 * SEG)
    a = entry_of("a", backend)
    cache.admit(a)
    assert cache.victims_for(2 * SEG) == []  # 3 segments free
    assert cache.reserve(2 * SEG)  # a capture in flight holds two of them
    assert cache.victims_for(2 * SEG) == [a]  # 1 free: a must go for two more
    cache.unreserve(2 * SEG)
    assert cache.victims_for(2 * SEG) == [] and not a.is_retired


def test_candidate_that_cannot_fit_is_refused_and_nothing_is_evicted():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=2 * SEG)
    small = entry_of("small", backend)
    big = entry_of("big", backend, numel=3 * 256)  # 3 segments
    cache.admit(small)
    assert cache.admit(big) is False
    assert not small.is_retired and cache.resident_bytes == SEG


def test_clear_retires_every_entry_and_reports_the_cause():
    backend = SimBackend(segment_bytes=SEG)
    causes = []
    cache = GraphCache(max_bytes=4 * SEG, on_evict=lambda e, cause: causes.append(cause))
    entries = [entry_of(n, backend) for n in "ab"]
    for e in entries:
        cache.admit(e)
    assert cache.clear("close") == 2
    assert all(e.is_retired for e in entries) and causes == ["close", "close"]
    assert cache.resident_bytes == 0 and len(cache) == 0


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        GraphCache(max_bytes=-1)


def test_an_entry_pinned_twice_stays_pinned_until_both_release():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=SEG)
    a, b = entry_of("a", backend), entry_of("b", backend)
    cache.admit(a)
    first = cache.acquire(a.key)
    cache.acquire(a.key)  # a second replay of the same graph, in flight on another thread
    cache.release(first)
    assert cache.admit(b) is False and not a.is_retired


def test_a_reader_pinning_every_entry_leaves_a_replays_pin_in_place():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=SEG)
    a, b = entry_of("a", backend), entry_of("b", backend)
    cache.admit(a)
    cache.acquire(a.key)  # a replay in flight
    cache.release_all(cache.acquire_all())  # export reads every entry meanwhile
    assert cache.admit(b) is False and not a.is_retired


def test_mean_entry_bytes_is_rounded_down_to_whole_bytes():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=8 * SEG)
    for name, numel in (("a", 256), ("b", 256), ("c", 512)):  # 1, 1 and 2 segments
        cache.admit(entry_of(name, backend, numel))
    assert cache.mean_entry_bytes() == 4 * SEG // 3


def test_a_zero_budget_falls_back_over_budget_from_the_first_call(make_runner):
    runner = make_runner(max_bytes=0)
    runner(*inputs(2))
    assert runner.stats()["fallbacks"] == {"over_budget": 1}


def test_an_entry_evicted_for_room_is_reported_with_the_budget_cause():
    backend = SimBackend(segment_bytes=SEG)
    causes = []
    cache = GraphCache(max_bytes=SEG, on_evict=lambda e, cause: causes.append(cause))
    cache.admit(entry_of("a", backend))
    cache.admit(entry_of("b", backend))
    assert causes == [EvictionCause.BUDGET]


def test_evict_reports_whether_the_key_was_admitted():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=SEG)
    a = entry_of("a", backend)
    cache.admit(a)
    assert cache.evict(a.key, "reverify") is True
    assert cache.evict(a.key, "reverify") is False


def test_an_eviction_is_logged_with_its_key_bytes_cause_and_replays(caplog):
    caplog.set_level(logging.INFO, logger="graphguard")
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=SEG)
    a = entry_of("a", backend)
    cache.admit(a)
    a.replay()
    cache.evict(a.key, "reverify")
    assert caplog.messages == [
        f"graphguard evict key={a.key.describe()} bytes={SEG} cause=reverify replays=1"
    ]


def test_a_key_is_admitted_once():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=4 * SEG)
    cache.admit(entry_of("a", backend))
    with pytest.raises(ValueError, match="^one admitted entry per key: "):
        cache.admit(entry_of("a", backend))
    assert len(cache) == 1 and cache.resident_bytes == SEG


def test_reservations_add_up_and_only_reserved_bytes_go_back():
    cache = GraphCache(max_bytes=4 * SEG)
    assert cache.reserve(SEG) and cache.reserve(2 * SEG)
    assert cache.reserved_bytes == 3 * SEG
    cache.unreserve(0)  # nothing held back is nothing given back
    with pytest.raises(ValueError, match="^unreserve of 3073 bytes; 3072 reserved"):
        cache.unreserve(3 * SEG + 1)
    cache.unreserve(3 * SEG)
    assert cache.reserved_bytes == 0
