"""A runner's decisions as values, so that deciding a call and carrying it out can be apart.

One process decides and acts under one hold of the runner's lock (`Runner.run`). Where one
runner's decision must drive others (tensor-parallel ranks, graphguard.engine.parallel), it is
made with `Runner.decide` and carried out everywhere with `Runner.follow`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from graphguard.core.keys import GraphKey
from graphguard.core.reasons import FallbackReason


class Action(enum.StrEnum):
    """What a runner does with one call, or between calls."""

    REPLAY = "replay"  # replay the key's admitted graph
    CAPTURE = "capture"  # capture the key in this call
    START_CAPTURE = "start_capture"  # start capturing the key between calls; answer eagerly
    FALLBACK = "fallback"  # answer eagerly, with `reason`
    ADVANCE = "advance"  # between calls: run the next unit of the capture in flight
    CANCEL = "cancel"  # between calls: cancel the capture in flight (the gate closed)
    IDLE = "idle"  # between calls: nothing in flight


@dataclass(frozen=True)
class Decision:
    """One decision of a runner. `resident` lists the keys admitted when it was made: a runner
    that follows it first evicts whatever else it holds, so its cache is the decider's."""

    action: Action
    key: GraphKey | None = None
    reason: FallbackReason | None = None
    resident: tuple[GraphKey, ...] = ()
    # an admitted larger bucket of `key` that answers the call instead of eager (the kind's
    # `cover`): with REPLAY, or with START_CAPTURE while `key` is captured
    cover: GraphKey | None = None

    @classmethod
    def fallback(cls, reason: FallbackReason) -> Decision:
        return cls(Action.FALLBACK, reason=reason)


class DecisionError(RuntimeError):
    """A runner cannot carry out a decision another runner made: their states differ."""
