"""GraphEntry: one captured graph and everything it owns.

An entry exclusively owns its graph, its capture stream, its memory pool (private, or its share
of a declared PoolGroup), its static inputs and outputs, its pinned host staging buffers and the
owners a caller retains through it. `retire()` releases all of it in a fixed order, is
idempotent, works while other references to the entry remain, and leaves an entry that refuses
to replay. Nothing here depends on garbage collection.
"""

from __future__ import annotations

import enum
import gc
import threading
import time
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from graphguard.core.backends import Backend
from graphguard.core.holes import HoleCall
from graphguard.core.keys import GraphKey

_OPAQUE = (type, str, bytes, int, float, types.ModuleType)
# How many objects the cycle check walks before it gives up looking (and accepts the owner).
_MAX_CYCLE_SCAN = 200_000


class EntryState(enum.StrEnum):
    NEW = "new"
    CAPTURED = "captured"
    ADMITTED = "admitted"
    RETIRED = "retired"


class RetiredEntryError(RuntimeError):
    """Replay of an entry that was retired (evicted, invalidated or closed)."""


class OwnerCycleError(ValueError):
    """An owner handed to retain() refers back to the graph it would be kept alive by."""


@dataclass
class PoolGroup:
    """A declared group of entries that share one memory pool and one capture stream.

    Entries of a group are charged the growth of the shared pool during their own capture; the
    pool is released when the last member retires.
    """

    name: str
    pool: Any = None
    stream: Any = None
    num_members: int = 0
    charged_bytes: int = 0  # the pool's reserved bytes, all charged to members so far
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def join(self, backend: Backend) -> tuple[Any, Any]:
        """Add a member; the first one creates the shared pool and stream."""
        with self.lock:
            if self.pool is None:
                self.pool, self.stream = backend.new_pool(), backend.new_stream()
            self.num_members += 1
            return self.stream, self.pool

    def leave(self, backend: Backend) -> None:
        """Remove a member; the last one releases the pool and the stream (exactly once)."""
        with self.lock:
            self.num_members -= 1
            if self.num_members > 0:
                return
            pool, stream, self.pool, self.stream = self.pool, self.stream, None, None
            self.charged_bytes = 0
        backend.release_pool(pool)
        backend.release_stream(stream)


@dataclass
class EntryInfo:
    """A read-only snapshot of an entry, for stats(), /v1/graphs and export."""

    key: str
    state: str
    rows: int | None
    resident_bytes: int
    host_bytes: int
    capture_ms: float
    replays: int
    verified: str
    input_specs: list[dict[str, Any]]
    output_specs: list[dict[str, Any]]
    # verify="spread": eager's own run-to-run spread and the graph's distance from eager
    eager_spread: float | None = None
    graph_error: float | None = None
    num_holes: int = 0  # eager calls between its graphs at every replay (core/holes.py)


class GraphEntry:
    """One captured graph (see module docstring for ownership and retirement rules)."""

    def __init__(self, key: GraphKey, backend: Backend, group: PoolGroup | None = None):
        self.key = key
        self.backend = backend
        self.group = group
        self.state = EntryState.NEW
        self.lock = threading.Lock()  # serializes replay launch against retire
        if group is None:
            self.stream, self.pool = backend.new_stream(), backend.new_pool()
        else:
            self.stream, self.pool = group.join(backend)
        self.event = backend.new_event()
        self.replay_stream: Any = None  # the caller's stream of the last replay (None: none yet)
        self.event_pending = False  # the event was recorded after the last staged replay
        self.graph: Any = None
        self.static_args: list[Any] = []
        self.static_outputs: Any = None
        self.staging: dict[int, torch.Tensor] = {}  # pinned host buffers, by argument position
        self.owners: list[Any] = []
        self.resident_bytes = 0
        self.host_bytes = 0
        self.transient_bytes = 0  # device bytes its capture holds outside the pool (state saved)
        self.capture_ms = 0.0
        self.replays = 0
        self.verified = "pending"
        self.eager_spread: list[float] | None = None  # per output, with verify="spread"
        self.graph_error: list[float] | None = None
        self.pin_count = 0  # > 0 while a replay is in progress; eviction skips pinned entries

    # -- ownership -------------------------------------------------------------------------
    def retain(self, owner: Any, *, checked: bool = False) -> None:
        """Keep `owner` alive exactly as long as this graph can replay. `checked`: the caller
        has searched `owner` for a way back to this entry already (check_owners)."""
        if self.state is EntryState.RETIRED:
            raise RetiredEntryError(
                f"cannot retain an owner on retired graph {self.key.describe()}"
            )
        if not checked:
            check_owners([owner], (self, self.graph), self.key)
        self.owners.append(owner)

    def allocating(self) -> AbstractContextManager[None]:
        """Allocations made inside go to this entry's pool (its static inputs)."""
        return self.backend.allocating(self.pool, self.stream)

    def add_staging(self, position: int, like: torch.Tensor) -> torch.Tensor:
        buffer = self.backend.pin(torch.empty_like(like, device="cpu"))
        self.staging[position] = buffer
        self.host_bytes += buffer.untyped_storage().nbytes()
        return buffer

    # -- capture ---------------------------------------------------------------------------
    def warm_up(self, fn: Callable[..., Any]) -> None:
        """One warm-up run on the static inputs, in the pool, on the entry's stream (the
        backend's `num_warmup` of them come before capture()); raises CaptureError."""
        started = time.perf_counter()
        self.backend.warm_up(fn, self.static_args, pool=self.pool, stream=self.stream)
        self.capture_ms += (time.perf_counter() - started) * 1e3

    def capture(
        self, fn: Callable[..., Any], static_args: list[Any], holes: Sequence[HoleCall] = ()
    ) -> None:
        """Capture `fn(*static_args)` (after the warm-ups), split at its `holes` (the record
        run's: graphguard/core/holes.py); raises CaptureError (and leaves the entry to retire).
        `capture_ms` is the warm-ups' time and the capture's."""
        self.static_args = static_args
        started = time.perf_counter()
        self.graph, self.static_outputs = self.backend.capture(
            fn, static_args, pool=self.pool, stream=self.stream, holes=holes
        )
        self.capture_ms += (time.perf_counter() - started) * 1e3
        # NOTE: static inputs, warm-up blocks and the BLAS workspace all live in the pool, so
        # its reserved segments are the whole device charge; a group member is charged the
        # growth since the group's previous capture.
        pool_bytes = self.backend.pool_reserved_bytes(self.pool)
        self.resident_bytes = pool_bytes - (self.group.charged_bytes if self.group else 0)
        if self.group is not None:
            self.group.charged_bytes = pool_bytes
        self.state = EntryState.CAPTURED

    # -- replay ----------------------------------------------------------------------------
    def replay(self, copy_inputs: Callable[[], None] | None = None) -> Any:
        """Launch one replay on the caller's current stream; returns the static outputs.

        The launch is ordered after the caller's earlier work by its stream, like any kernel;
        the entry remembers that stream so that retire() can wait for the replay.
        """
        with self.lock:
            if self.state is EntryState.RETIRED or self.graph is None:
                raise RetiredEntryError(f"graph {self.key.describe()} is retired; it cannot replay")
            if copy_inputs is not None:
                copy_inputs()
            self.graph.replay()
            self.replay_stream = self.backend.current_stream()
            if self.staging:
                # NOTE: the next call's host writes into the staging buffers wait on this.
                self.backend.record(self.event, self.replay_stream)
                self.event_pending = True
            self.replays += 1
            return self.static_outputs

    def wait_staging(self) -> None:
        """Host-wait until the last replay's asynchronous copies out of staging are done."""
        if self.event_pending:
            self.backend.wait(self.event)

    def wait_idle(self) -> None:
        """Host-wait for this entry's last replay, on whichever stream it ran (an event
        recorded there now; never the waiting thread's current stream)."""
        if self.replay_stream is not None:
            self.backend.record(self.event, self.replay_stream)
            self.backend.wait(self.event)

    # -- retirement ------------------------------------------------------------------------
    def retire(self) -> bool:
        """Release everything in order. Idempotent: returns False if already retired."""
        with self.lock:
            if self.state is EntryState.RETIRED:
                return False
            self.state = EntryState.RETIRED
            # NOTE: wait on the recorded replay event, never on the retiring thread's current
            # stream, so staging buffers outlive an in-flight asynchronous replay.
            self.wait_idle()
            if self.graph is not None:
                self.backend.reset(self.graph)
            self.graph = None
            self.static_args, self.static_outputs = [], None
            self.staging.clear()
            self._release_pool_and_stream()
            self.owners.clear()
            return True

    def _release_pool_and_stream(self) -> None:
        group = self.group
        if group is None:
            self.backend.release_pool(self.pool)
            self.backend.release_stream(self.stream)
        else:
            group.leave(self.backend)
        self.pool = self.stream = None

    @property
    def is_retired(self) -> bool:
        return self.state is EntryState.RETIRED

    def info(self) -> EntryInfo:
        return EntryInfo(
            key=self.key.describe(),
            state=self.state.value,
            rows=self.key.rows,
            resident_bytes=self.resident_bytes,
            host_bytes=self.host_bytes,
            capture_ms=round(self.capture_ms, 3),
            replays=self.replays,
            verified=self.verified,
            input_specs=[_spec(t) for t in self.static_args if isinstance(t, torch.Tensor)],
            output_specs=[
                _spec(t)
                for t in tree_flatten(self.static_outputs)[0]
                if isinstance(t, torch.Tensor)
            ],
            eager_spread=_largest(self.eager_spread),
            graph_error=_largest(self.graph_error),
            num_holes=getattr(self.graph, "num_holes", 0),
        )


def _largest(values: list[float] | None) -> float | None:
    return None if values is None else max(values, default=0.0)


def _spec(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "stride": list(t.stride()),
        "device": str(t.device),
    }


def check_owners(owners: Sequence[Any], targets: tuple[Any, ...], key: GraphKey) -> None:
    """OwnerCycleError if an owner reaches `targets` (what holds the graph of `key`): retaining
    it would make a cycle that keeps the graph alive forever."""
    for owner in owners:
        if refers_to(owner, targets):
            raise OwnerCycleError(
                f"{type(owner).__name__} refers back to graph {key.describe()}; retaining it "
                "would make a reference cycle that keeps the graph alive forever"
            )


def refers_to(root: Any, targets: tuple[Any, ...]) -> bool:
    """True if `root` reaches any of `targets` through Python references."""
    wanted = {id(t) for t in targets if t is not None}
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < _MAX_CYCLE_SCAN:
        obj = stack.pop()
        if id(obj) in wanted:
            return True
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            # A function reaches its whole module through __globals__: follow only what it
            # closes over and its defaults.
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return False


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True
