"""Graph keys and bucket tables.

A GraphKey names one captured graph: the padded shape, dtype and device of every tensor
argument plus the values of the non-tensor arguments. Buckets pad dimension 0 (the batch) up to
the next declared size, so a handful of graphs serve every batch size below the largest bucket.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class TensorSpec(NamedTuple):
    """What a graph needs to know about one tensor argument (hashable)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def describe(self) -> str:
        dims = "x".join(str(s) for s in self.shape) or "scalar"
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]@{self.device}"


class GraphKey(NamedTuple):
    """One graph: the (padded) spec of each argument, in call order.

    Tensor arguments appear as TensorSpec; other arguments as their own (hashable) value, since
    a graph bakes them in. `rows` is the padded batch size (None without buckets).
    """

    args: tuple[Any, ...]
    rows: int | None = None

    @property
    def tensor_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(a for a in self.args if isinstance(a, TensorSpec))

    @property
    def input_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensor_specs)

    def describe(self) -> str:
        parts = [a.describe() if isinstance(a, TensorSpec) else repr(a) for a in self.args]
        return "(" + ", ".join(parts) + ")"

    def with_rows(self, rows: int) -> GraphKey:
        """The same call padded to `rows` rows: every tensor's dimension 0 (a bucketed key
        pads all of them alike)."""
        return GraphKey(
            tuple(
                TensorSpec((rows, *a.shape[1:]), a.dtype, a.device)
                if isinstance(a, TensorSpec) and a.shape
                else a
                for a in self.args
            ),
            rows,
        )


@dataclass(frozen=True)
class Buckets:
    """Pad-up table for dimension 0 of every tensor argument.

    `batch` lists the graph sizes; a call with n rows runs on the smallest bucket >= n, its
    inputs padded with `pad_value` (one value for all inputs, or one per positional argument),
    and its outputs sliced back to n rows. Validated at construction: positive, strictly
    increasing after sorting, no duplicates.
    """

    batch: Sequence[int]
    pad_value: float | int | Sequence[float | int] = 0

    def __post_init__(self) -> None:
        sizes = tuple(int(b) for b in self.batch)
        if not sizes:
            raise ValueError("Buckets(batch=...) needs at least one size")
        if any(b <= 0 for b in sizes):
            raise ValueError(f"bucket sizes must be positive, got {sizes}")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"bucket sizes must be distinct, got {sizes}")
        object.__setattr__(self, "batch", tuple(sorted(sizes)))
        if not isinstance(self.pad_value, (int, float)):
            object.__setattr__(self, "pad_value", tuple(self.pad_value))

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket >= rows, or None when rows exceeds the largest bucket."""
        sizes: tuple[int, ...] = self.batch  # type: ignore[assignment]
        index = bisect.bisect_left(sizes, rows)
        return sizes[index] if index < len(sizes) else None

    def has_pad_for(self, position: int) -> bool:
        return isinstance(self.pad_value, (int, float)) or position < len(self.pad_value)

    def pad_for(self, position: int) -> float | int:
        """The pad value of the positional argument at `position`."""
        if isinstance(self.pad_value, (int, float)):
            return self.pad_value
        if position >= len(self.pad_value):
            raise ValueError(
                f"Buckets.pad_value lists {len(self.pad_value)} values but argument {position} "
                "is a tensor; give one pad value per positional argument"
            )
        return self.pad_value[position]


def pad_ladder(sizes: Sequence[int], max_pad_factor: int) -> list[int]:
    """The fewest of the bucket `sizes` whose graphs answer a call of every one of them when a
    call may replay a larger bucket's graph of at most `max_pad_factor` times its rows
    (GraphRunner `max_pad_factor`), largest first: the largest size, then each size that the
    last one taken is too large for. With a factor of 1 no call replays another bucket's
    graph: the smallest size alone."""
    ordered = sorted(set(sizes), reverse=True)
    if max_pad_factor < 2:
        return ordered[-1:]
    ladder = ordered[:1]
    for size in ordered[1:]:
        if size * max_pad_factor < ladder[-1]:
            ladder.append(size)
    return ladder


def spec_of(tensor: torch.Tensor, rows: int | None = None) -> TensorSpec:
    """The spec of `tensor`, with dimension 0 replaced by `rows` when given."""
    shape = tuple(tensor.shape)
    if rows is not None:
        shape = (rows,) + shape[1:]
    return TensorSpec(shape, tensor.dtype, tensor.device)
