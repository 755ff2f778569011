"""What a runner needs to know about the graphs it keeps: the kind's side of the runner.

A Runner (graphguard.core.runner) owns the flow of a call and every rule (the gate, admission,
the budget, parity's verdicts, quarantine, metrics). A kind owns what differs between single
graphs (graphguard.core.graph_runner) and groups of segment graphs (graphguard.segmented.runner):
how a call maps to a key, how an entry replays, how a candidate is captured and checked, and
what answers a call eagerly. A kind decides nothing and counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

from graphguard.core.capture import CaptureMode, CaptureUnits
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import FallbackReason

E = TypeVar("E")
C = TypeVar("C")


class Replayed(NamedTuple):
    """A replay's answer; `reason` when the call counts as a fallback even so (its answer is
    then eager or partly eager), `drift` when a re-verification found the entry differing from
    eager (the runner retires and quarantines it)."""

    answer: Any
    reason: FallbackReason | None = None
    drift: Exception | None = None


class GraphKind(Protocol[E, C]):
    def plan(self, call: C) -> CallPlan | FallbackReason:
        """The key `call` maps to (with its real rows), or why it cannot replay."""
        ...

    def eager(self, call: C) -> Any:
        """The call's answer without graphs."""
        ...

    def example(self, key: GraphKey) -> tuple[C, CallPlan]:
        """Inputs of `key` a capture between calls may run on at any time (all-padding rows:
        they write only state no real row reads), and their plan."""
        ...

    def new_candidate(self, key: GraphKey) -> E:
        """An empty entry for `key`, owning its pool and stream until it retires."""
        ...

    def capture(self, candidate: E, call: C, plan: CallPlan) -> CaptureUnits:
        """Capture `candidate` on `call` and check its first replay against eager, yielding
        between bounded units of work; returns the Verdict (the runner admits or rejects)."""
        ...

    def replay(self, entry: E, call: C, plan: CallPlan) -> Replayed:
        """Replay a pinned admitted entry for `call`."""
        ...

    def admitted(self, candidate: E, outputs: Any, plan: CallPlan, mode: CaptureMode) -> Any:
        """An admitted candidate's log line, and its first outputs as the call's answer when a
        call earned it (ON_CALL; else None)."""
        ...

    def cover(self, key: GraphKey, is_admitted: Callable[[GraphKey], bool]) -> GraphKey | None:
        """An admitted key that may answer a call of `key`, which has no graph, instead of
        eager (single graphs: a larger bucket within `max_pad_factor`); None: none may."""
        ...

    def num_graphs(self, entry: E) -> int:
        """How many graphs one entry holds."""
        ...
