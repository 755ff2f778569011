"""SegmentGroup: the segment graphs of one shape key, owned and evicted as a unit.

A group declares one PoolGroup, so its segments share one memory pool and one capture stream
that no other key uses; retiring the group retires every segment, and the last one releases
the pool and the stream. A group is one of the cache's Retirable units, like a GraphEntry (key,
resident and host bytes, pin count, state, replays, retire), so the cache's budget, LRU order
and pinning apply to the group whole.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from graphguard.core.backends import Backend
from graphguard.core.entry import EntryInfo, EntryState, GraphEntry, PoolGroup, check_owners
from graphguard.core.inputs import CallPlan, copy_inputs, make_static_args
from graphguard.core.keys import GraphKey, spec_of
from graphguard.segmented.pipeline import Carry, Piece, Segment, run_eager, run_piece


@dataclass
class GroupInfo:
    """A read-only snapshot of a group, for stats() and logs."""

    key: str
    state: str
    resident_bytes: int
    capture_ms: float
    replays: int
    verified: str
    segments: list[EntryInfo] = field(default_factory=list)


class SegmentGroup:
    """Every segment graph of one shape key (see module docstring)."""

    def __init__(self, key: GraphKey, backend: Backend, name: str):
        self.key = key
        self.backend = backend
        self.pool_group = PoolGroup(f"{name}:{key.describe()}")
        self.entries: list[GraphEntry] = []  # in pipeline order
        # per entry: the carry positions whose static input is the segment before's output
        self.passed_through: list[tuple[int, ...]] = []
        self.state = EntryState.NEW
        self.pin_count = 0  # > 0 while a replay is in progress (GraphCache.acquire)
        self.replays = 0
        self.verified = "pending"

    def add_entry(self, key: GraphKey) -> GraphEntry:
        """A new segment graph sharing the group's pool and capture stream."""
        entry = GraphEntry(key, self.backend, self.pool_group)
        self.entries.append(entry)
        return entry

    @property
    def resident_bytes(self) -> int:
        # NOTE: each segment is charged its own growth of the shared pool plus its static
        # inputs, so the sum is the group's whole footprint, counted once.
        return sum(entry.resident_bytes for entry in self.entries)

    @property
    def transient_bytes(self) -> int:
        return sum(entry.transient_bytes for entry in self.entries)

    @property
    def host_bytes(self) -> int:
        return sum(entry.host_bytes for entry in self.entries)

    @property
    def capture_ms(self) -> float:
        return sum(entry.capture_ms for entry in self.entries)

    @property
    def pool(self) -> Any:
        return self.pool_group.pool

    @property
    def stream(self) -> Any:
        return self.pool_group.stream

    @property
    def is_retired(self) -> bool:
        return self.state is EntryState.RETIRED

    def mark_admitted(self, verified: str) -> None:
        self.state = EntryState.ADMITTED
        self.verified = verified
        for entry in self.entries:
            entry.state, entry.verified = EntryState.ADMITTED, verified

    def retire(self) -> bool:
        """Retire every segment; the last releases the pool and stream. Idempotent."""
        if self.state is EntryState.RETIRED:
            return False
        self.state = EntryState.RETIRED
        for entry in reversed(self.entries):
            entry.retire()
        return True

    def info(self) -> GroupInfo:
        return GroupInfo(
            key=self.key.describe(),
            state=self.state.value,
            resident_bytes=self.resident_bytes,
            capture_ms=round(self.capture_ms, 3),
            replays=self.replays,
            verified=self.verified,
            segments=[entry.info() for entry in self.entries],
        )


class GroupOverBudget(Exception):
    """The group outgrew the whole budget while its segments were being captured."""


def carry_key(carry: Carry) -> GraphKey:
    """The key of a carry: the exact shape, dtype and device of each tensor."""
    return GraphKey(tuple(spec_of(t) for t in carry))


def capture_group(
    group: SegmentGroup,
    pieces: Sequence[Piece],
    carry: Carry,
    context: Any,
    owners: Sequence[Any],
    max_bytes: int,
) -> Generator[None, None, Carry]:
    """Capture each segment in order on the call's inputs, with the eager stages between,
    yielding after each unit of work: a segment's static inputs and first warm-up, each
    further warm-up, its capture and first replay with the eager stage after it.

    NOTE: a segment's replay and the eager stage after it are one unit: that stage may read
    what the replay wrote outside the carry (the engine's K/V), and on a capture between steps
    those writes go to the dummy block, which the steps run between units write too.

    Returns the output of the graphed path (each segment's first replay), for the parity check.
    Raises CaptureError, or GroupOverBudget as soon as the group alone exceeds `max_bytes`
    (later segments only add bytes). The caller retires the group on either.
    """
    # NOTE: an owner could reach a segment's entry only through its group (the entries are
    # new), so each owner is searched for a cycle once, against the group: a search walks the
    # owner's whole object graph (a model: 20 ms and more), once per segment was most of a
    # group capture's time.
    check_owners(owners, (group,), group.key)
    previous: tuple[Any, ...] = ()  # the last segment's static outputs
    replayed = False  # a segment's first replay waits for the eager stage after it
    for piece in pieces:
        if not isinstance(piece, Segment):
            carry = run_piece(piece, carry, context)
            if replayed:
                replayed = False
                yield
            continue
        entry = group.add_entry(carry_key(carry))
        # NOTE: what an eager stage passes through from the segment before (the engine's
        # residual stream, RoPE tables and cache slots) is read where that segment's graph
        # writes it: no copy (replay_group checks that a call passes it through too).
        passed = tuple(i for i, arg in enumerate(carry) if any(arg is t for t in previous))
        group.passed_through.append(passed)
        for owner in owners:
            entry.retain(owner, checked=True)
        plan = CallPlan(entry.key, None)
        static_args = make_static_args(entry, list(carry), plan, None, own=passed)
        for _ in range(entry.backend.num_warmup):
            entry.warm_up(piece)
            yield
        entry.capture(piece, static_args)
        if group.resident_bytes > max_bytes:
            raise GroupOverBudget
        carry = previous = tuple(entry.replay())
        replayed = True
    if replayed:
        yield
    return carry


def replay_group(
    group: SegmentGroup, pieces: Sequence[Piece], carry: Carry, context: Any
) -> tuple[Carry, bool]:
    """Replay the segments with the eager stages between; (output, every segment replayed).

    If an eager stage hands a segment a carry its graph was not captured for (other shapes, or
    a new tensor where it passed the segment before's output through at capture), the rest of
    the pipeline runs eagerly and the flag is False.
    """
    entries = iter(zip(group.entries, group.passed_through, strict=True))
    for index, piece in enumerate(pieces):
        if not isinstance(piece, Segment):
            carry = run_piece(piece, carry, context)
            continue
        entry, passed = next(entries)
        # NOTE: a passed-through position's static input is the segment before's output, which
        # other positions may hold too: a new tensor there cannot be copied in.
        if carry_key(carry) != entry.key or any(
            carry[i] is not entry.static_args[i] for i in passed
        ):
            return run_eager(pieces[index:], carry, context), False
        plan = CallPlan(entry.key, None)
        outputs = entry.replay(partial(copy_inputs, entry, list(carry), plan, None))
        carry = tuple(outputs)
    return carry, True
