"""GraphCache: admitted graphs under a byte budget, least recently used first out.

Invariant: after every operation the resident bytes of the admitted entries, plus the bytes
reserved for captures in flight, sum to at most `max_bytes`. Entries pinned (by an in-progress
replay, or by a reader such as export) are never evicted. The cache holds Retirable units: a
GraphEntry, or a SegmentGroup evicted whole.

Lock order (written here because this is where the lock lives): an engine's lifecycle lock,
then the runner's replay lock, then this cache's lock. Code holding the cache lock never takes
either of the others.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from graphguard.core.entry import EntryState
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import EvictionCause

log = logging.getLogger("graphguard")


class Retirable(Protocol):
    """What the cache holds: a GraphEntry, or a SegmentGroup of segment graphs (one unit)."""

    # NOTE: the cache writes these two, under its lock: the pins of a replay or a reader, and
    # the ADMITTED state on admission.
    pin_count: int
    state: EntryState

    @property
    def key(self) -> GraphKey: ...
    @property
    def resident_bytes(self) -> int: ...
    @property
    def host_bytes(self) -> int: ...
    @property
    def transient_bytes(self) -> int: ...
    @property
    def replays(self) -> int: ...
    def retire(self) -> bool: ...


E = TypeVar("E", bound=Retirable)


class GraphCache(Generic[E]):
    """Admitted entries by key, in least-recently-used order."""

    def __init__(self, max_bytes: int, on_evict: Callable[[E, EvictionCause], None] | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.lock = threading.RLock()
        self._entries: OrderedDict[GraphKey, E] = OrderedDict()
        self._resident_bytes = 0
        self._reserved_bytes = 0  # held for captures in flight (reserve / unreserve)
        self._on_evict = on_evict

    # -- lookup ----------------------------------------------------------------------------
    def acquire(self, key: GraphKey) -> E | None:
        """The admitted entry for `key`, most recently used from now and pinned until
        release(); None when the key is not admitted."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.pin_count += 1
            return entry

    def release(self, entry: E) -> None:
        with self.lock:
            entry.pin_count -= 1

    def acquire_all(self) -> list[E]:
        """Every admitted entry, least recently used first, pinned until release_all()."""
        with self.lock:
            entries = list(self._entries.values())
            for entry in entries:
                entry.pin_count += 1
            return entries

    def release_all(self, entries: list[E]) -> None:
        with self.lock:
            for entry in entries:
                entry.pin_count -= 1

    def __contains__(self, key: GraphKey) -> bool:
        with self.lock:
            return key in self._entries

    def __len__(self) -> int:
        with self.lock:
            return len(self._entries)

    @property
    def resident_bytes(self) -> int:
        with self.lock:
            return self._resident_bytes

    @property
    def reserved_bytes(self) -> int:
        with self.lock:
            return self._reserved_bytes

    def entries(self) -> list[E]:
        with self.lock:
            return list(self._entries.values())

    def mean_entry_bytes(self) -> int:
        with self.lock:
            return self._resident_bytes // len(self._entries) if self._entries else 0

    # -- budget ----------------------------------------------------------------------------
    def victims_for(self, num_bytes: int) -> list[E] | None:
        """The LRU unpinned entries whose eviction makes room for `num_bytes`.

        Empty when it fits already; None when it cannot fit even after evicting every unpinned
        entry (or exceeds the whole budget).
        """
        with self.lock:
            if num_bytes > self.max_bytes:
                return None
            free = self.max_bytes - self._resident_bytes - self._reserved_bytes
            victims: list[E] = []
            for entry in self._entries.values():
                if free >= num_bytes:
                    break
                if entry.pin_count == 0:
                    victims.append(entry)
                    free += entry.resident_bytes
            return victims if free >= num_bytes else None

    def admit(self, entry: E) -> bool:
        """Insert a captured entry, evicting LRU unpinned entries to make room.

        Returns False (and leaves the entry to the caller to retire) when it cannot fit.
        """
        with self.lock:
            if entry.key in self._entries:
                raise ValueError(f"one admitted entry per key: {entry.key.describe()} is admitted")
            victims = self.victims_for(entry.resident_bytes)
            if victims is None:
                return False
            for victim in victims:
                self._remove(victim, EvictionCause.BUDGET)
            self._entries[entry.key] = entry
            self._resident_bytes += entry.resident_bytes
            entry.state = EntryState.ADMITTED
            assert self._resident_bytes + self._reserved_bytes <= self.max_bytes
            return True

    def reserve(self, num_bytes: int) -> bool:
        """Hold `num_bytes` for a capture in flight, evicting LRU unpinned entries to make room,
        so the device never holds more than the budget while it runs. False (nothing evicted,
        nothing held) when they cannot fit."""
        with self.lock:
            victims = self.victims_for(num_bytes)
            if victims is None:
                return False
            for victim in victims:
                self._remove(victim, EvictionCause.BUDGET)
            self._reserved_bytes += num_bytes
            return True

    def unreserve(self, num_bytes: int) -> None:
        """Give back bytes a capture held (it was admitted, rejected or cancelled)."""
        with self.lock:
            if not 0 <= num_bytes <= self._reserved_bytes:
                raise ValueError(f"unreserve of {num_bytes} bytes; {self._reserved_bytes} reserved")
            self._reserved_bytes -= num_bytes

    def evict(self, key: GraphKey, cause: EvictionCause | str) -> bool:
        """Evict one key if admitted, pinned or not (reverify and tests force it). True if
        removed; a replay in flight finishes first, since retire waits on its event."""
        cause = EvictionCause(cause)  # a closed set: an unknown cause is a ValueError
        with self.lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            self._remove(entry, cause)
            return True

    def clear(self, cause: EvictionCause | str) -> int:
        """Retire every entry (close, reload). Returns how many were retired."""
        cause = EvictionCause(cause)
        with self.lock:
            entries = list(self._entries.values())
            for entry in entries:
                self._remove(entry, cause)
            return len(entries)

    def _remove(self, entry: E, cause: EvictionCause) -> None:
        del self._entries[entry.key]
        self._resident_bytes -= entry.resident_bytes
        entry.retire()
        log.info(
            "graphguard evict key=%s bytes=%d cause=%s replays=%d",
            entry.key.describe(),
            entry.resident_bytes,
            cause,
            entry.replays,
        )
        if self._on_evict is not None:
            self._on_evict(entry, cause)
