"""A small count-min frequency sketch with periodic halving (the TinyLFU admission filter).

It estimates how often each key was seen recently in fixed memory, however many distinct keys
arrive; halving every `sample_size` increments makes old popularity fade so that a newly hot key
can displace a formerly hot one.
"""

from __future__ import annotations

from collections.abc import Hashable

_SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


class FrequencySketch:
    def __init__(self, width: int = 1024, sample_size: int | None = None):
        if width <= 0 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two, got {width}")
        self.width = width
        self.sample_size = sample_size or 10 * width
        self._rows = [[0] * width for _ in _SEEDS]
        self._additions = 0

    def _slots(self, key: Hashable) -> list[int]:
        return [hash((seed, key)) & (self.width - 1) for seed in _SEEDS]

    def add(self, key: Hashable) -> None:
        for row, slot in zip(self._rows, self._slots(key), strict=True):
            row[slot] += 1
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
