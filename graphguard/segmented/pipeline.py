"""A model as an ordered list of stages; consecutive capturable stages form segments.

A pipeline threads a *carry* (a tuple of tensors) through its stages. A capturable stage is
``fn(*carry) -> carry`` and must be capturable in a CUDA graph (no host syncs, shapes that
depend only on the carry's shapes). An eager stage is ``fn(context, *carry) -> carry``: it may
read host-side state from ``context`` (variable-length attention metadata, routing tables) and
always runs eagerly, between the replays of the segments around it.

NOTE: verification runs the pipeline eagerly next to the graphs on the same inputs, so eager
stages with side effects must be idempotent (the engine's KV writes are: same slots, same
values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

Carry = tuple[Tensor, ...]


@dataclass(frozen=True)
class Stage:
    """One step of a pipeline; `eager=True` marks it eager-only (see module docstring)."""

    name: str
    fn: Callable[..., Carry]
    eager: bool = False


@dataclass(frozen=True)
class Segment:
    """Consecutive capturable stages, captured and replayed as one graph."""

    index: int  # position among the pipeline's segments
    stages: tuple[Stage, ...]

    @property
    def name(self) -> str:
        return "+".join(stage.name for stage in self.stages)

    def __call__(self, *carry: Tensor) -> Carry:
        for stage in self.stages:
            carry = tuple(stage.fn(*carry))
        return carry


Piece = Segment | Stage  # a segment, or an eager stage between segments


def split_segments(stages: Sequence[Stage]) -> tuple[Piece, ...]:
    """Group consecutive capturable stages into segments, keeping eager stages in between."""
    if not any(not stage.eager for stage in stages):
        raise ValueError("a segmented pipeline needs at least one capturable stage")
    pieces: list[Piece] = []
    run: list[Stage] = []
    num_segments = 0
    for stage in stages:
        if not stage.eager:
            run.append(stage)
            continue
        if run:
            pieces.append(Segment(num_segments, tuple(run)))
            num_segments, run = num_segments + 1, []
        pieces.append(stage)
    if run:
        pieces.append(Segment(num_segments, tuple(run)))
    return tuple(pieces)


def run_piece(piece: Piece, carry: Carry, context: Any) -> Carry:
    """One piece, eagerly."""
    if isinstance(piece, Segment):
        return piece(*carry)
    return tuple(piece.fn(context, *carry))


def run_eager(pieces: Sequence[Piece], carry: Carry, context: Any) -> Carry:
    """The pipeline (or its tail) without any graph: the reference every graph is checked by."""
    for piece in pieces:
        carry = run_piece(piece, carry, context)
    return carry
