"""Graphs with eager holes: capturable segments between eager-only modules (docs/segmented.md)."""

from graphguard.segmented.group import GroupInfo, SegmentGroup
from graphguard.segmented.pipeline import Carry, Piece, Segment, Stage, run_eager, split_segments
from graphguard.segmented.runner import SegmentedRunner, carry_key

__all__ = [
    "Carry",
    "GroupInfo",
    "Piece",
    "Segment",
    "SegmentGroup",
    "SegmentedRunner",
    "Stage",
    "carry_key",
    "run_eager",
    "split_segments",
]
