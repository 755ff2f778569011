import torch

from graphguard.core.cache import GraphCache
from graphguard.core.entry import GraphEntry
from graphguard.core.keys import GraphKey
from graphguard.core.sim import SimBackend

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
    with cache.pinned(a.key):
        pass  # touching a makes b the least recently used
    assert cache.admit(d)
    assert b.is_retired and not a.is_retired
    assert cache.resident_bytes == 3 * SEG


def test_eviction_skips_pinned_entries():
    backend = SimBackend(segment_bytes=SEG)
    cache = GraphCache(max_bytes=2 * SEG)
    a, b, c = (entry_of(n, backend) for n in "abc")
    cache.admit(a)
    cache.admit(b)
    with cache.pinned(a.key):
        assert cache.admit(c)
    assert not a.is_retired and b.is_retired


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
