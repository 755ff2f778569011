"""Graph decisions as values, so that one process can make them and others apply them.

A runner call is two halves: deciding what to do with it (the gate, the plan, admission: replay,
capture, start a capture between calls, or fall back with one reason) and doing it. In one
process a runner does both under its lock (`RunnerBase._run`). Under tensor parallelism every
rank holds a runner over its own shard, and a captured collective is itself a collective: the
ranks must replay, capture and fall back together. So rank 0's runner decides
(`RunnerBase.decide`), the Decision travels with the step's inputs, and every rank's runner,
rank 0's too, carries it out (`RunnerBase.follow`); a follower never decides alone.

What a rank only learns by doing it (a capture that failed, a parity mismatch, the bytes a graph
holds) is agreed after every unit of capture work (`Agreement.agree`): the worst outcome of any
rank rejects the candidate on every rank, and the largest rank's bytes are what every rank
charges, so the budget holds on every rank and the caches evict alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from graphguard.core.keys import GraphKey
from graphguard.core.reasons import CaptureOutcome, FallbackReason


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
    """One decision of a leading runner. `resident` lists the keys admitted when it was made:
    a follower first evicts whatever else it holds, so its cache is the leader's."""

    action: Action
    key: GraphKey | None = None
    reason: FallbackReason | None = None
    resident: tuple[GraphKey, ...] = ()
    # an admitted larger bucket of `key` that answers the call instead of eager (RunnerBase
    # _cover): with REPLAY, or with START_CAPTURE while `key` is captured
    cover: GraphKey | None = None

    @classmethod
    def fallback(cls, reason: FallbackReason) -> Decision:
        return cls(Action.FALLBACK, reason=reason)


class RankDivergence(RuntimeError):
    """A follower's runner cannot carry out its leader's decision: its state differs."""


# The rejected capture outcome behind each reason a capture's call falls back with.
OUTCOMES = {
    FallbackReason.CAPTURE_FAILED: CaptureOutcome.FAILED,
    FallbackReason.PARITY_MISMATCH: CaptureOutcome.PARITY_MISMATCH,
    FallbackReason.OVER_BUDGET: CaptureOutcome.OVER_BUDGET,
}
# Worst first: the outcome every rank takes when ranks disagree.
SEVERITY = (CaptureOutcome.FAILED, CaptureOutcome.PARITY_MISMATCH, CaptureOutcome.OVER_BUDGET)


@dataclass(frozen=True)
class Vote:
    """One rank's view after a unit of capture work: its rejection (None: fine so far), the
    candidate's bytes, and whether its capture has ended."""

    outcome: CaptureOutcome | None
    resident_bytes: int
    is_done: bool


class Agreement(Protocol):
    """Combines every rank's Vote into the one every rank acts on (a collective call)."""

    def agree(self, vote: Vote) -> Vote: ...


class SoloAgreement:
    """One process: its own vote is the agreed one."""

    def agree(self, vote: Vote) -> Vote:
        return vote


def worst_vote(votes: list[Vote]) -> Vote:
    """The agreed vote: the most severe rejection, the largest bytes; ended only if all ended
    (a RankDivergence when, with no rejection, some ended and some did not)."""
    rejected = [v.outcome for v in votes if v.outcome is not None]
    outcome = min(rejected, key=SEVERITY.index) if rejected else None
    ended = {v.is_done for v in votes}
    if outcome is None and len(ended) > 1:
        raise RankDivergence("ranks disagree on whether a capture has ended")
    num_bytes = max(v.resident_bytes for v in votes)
    return Vote(outcome, num_bytes, outcome is not None or ended == {True})


# How a runner's capture hook ends: (graph outputs, eager outputs or None, the reason or None).
Verified = tuple[Any, Any, FallbackReason | None]


def next_unit(units: Generator[None, None, Verified]) -> Verified | None:
    """Run one unit of capture work: None while the capture goes on, else how it ended here."""
    try:
        next(units)
    except StopIteration as stop:
        return stop.value
    return None


def vote_of(resident_bytes: int, verified: Verified | None) -> Vote:
    """This rank's vote after a unit: its rejection if it ended in one."""
    reason = verified[2] if verified is not None else None
    outcome = OUTCOMES[reason] if reason is not None else None
    return Vote(outcome, resident_bytes, verified is not None)


class Follows(Protocol):
    """What orders drive: a runner's decide() / follow() pairs (graphguard.core.following)."""

    def decide(self, call: Any) -> Decision: ...
    def follow(self, call: Any, decision: Decision) -> Any: ...
    def decide_between_calls(self) -> Decision: ...
    def follow_between_calls(self, decision: Decision) -> bool: ...


class Orders(Protocol):
    """Where a runner's decisions come from under tensor parallelism (None: it decides)."""

    def on_call(self, runner: Follows, call: Any) -> Any: ...
    def between_calls(self, runner: Follows) -> bool: ...


class LeaderOrders:
    """Rank 0: decide, send the decision to the followers, carry it out."""

    def __init__(self, send: Callable[[Decision], None]) -> None:
        self._send = send

    def on_call(self, runner: Follows, call: Any) -> Any:
        decision = runner.decide(call)
        self._send(decision)
        return runner.follow(call, decision)

    def between_calls(self, runner: Follows) -> bool:
        decision = runner.decide_between_calls()
        self._send(decision)
        return runner.follow_between_calls(decision)


class FollowerOrders:
    """Rank > 0: carry out the leader's decision for each call. Decisions between calls are
    the follower loop's to receive and hand to `follow_between_calls`."""

    def __init__(self, receive: Callable[[], Decision]) -> None:
        self._receive = receive

    def on_call(self, runner: Follows, call: Any) -> Any:
        return runner.follow(call, self._receive())

    def between_calls(self, runner: Follows) -> bool:
        raise RankDivergence("a follower's runner advances captures only on its leader's order")
