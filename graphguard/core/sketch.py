"""A small count-min frequency sketch with periodic halving (the TinyLFU admission filter).

It estimates how often each key was seen recently in fixed memory, however many distinct keys
arrive; halving every `sample_size` increments makes old popularity fade so that a newly hot key
can displace a formerly hot one.
"""

from __future__ import annotations

from collections.abc import Hashable

_SEEDS = (0x9E3779B97F4A7C15, 0x85EBCA77C2B2AE3D, 0xC2B2AE3D27D4EB2F, 0x27D4EB2F165667C5)
_MIX = 0xFF51AFD7ED558CCD
_MASK64 = (1 << 64) - 1
_MAX_KNOWN = 4096


class FrequencySketch:
    def __init__(self, width: int = 1024, sample_size: int | None = None):
        if width <= 0 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two, got {width}")
        self.width = width
        self.sample_size = sample_size or 10 * width
        self._rows = [[0] * width for _ in _SEEDS]
        self._additions = 0
        self._known: dict[Hashable, list[int]] = {}  # slots of recent keys (bounded)

    def _slots(self, key: Hashable) -> list[int]:
        # NOTE: one hash of the key (hashing a graph key walks its whole tuple), then one cheap
        # multiplicative mix per row: the rows stay independent enough for count-min.
        h = hash(key) & _MASK64
        mask = self.width - 1
        return [(((h ^ seed) * _MIX) & _MASK64) >> 40 & mask for seed in _SEEDS]

    def _cached_slots(self, key: Hashable) -> list[int]:
        slots = self._known.get(key)
        if slots is None:
            if len(self._known) >= _MAX_KNOWN:
                self._known.clear()
            slots = self._known[key] = self._slots(key)
        return slots

    def add(self, key: Hashable) -> None:
        a, b, c, d = self._cached_slots(key)
        rows = self._rows
        rows[0][a] += 1
        rows[1][b] += 1
        rows[2][c] += 1
        rows[3][d] += 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self._halve()

    def estimate(self, key: Hashable) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key), strict=True))

    def _halve(self) -> None:
        for row in self._rows:
            for i, count in enumerate(row):
                row[i] = count >> 1
        self._additions //= 2
