"""How tensor-parallel ranks agree on a capture, and follow one leader's graph decisions.

Every rank holds a runner over its own shard, and a captured collective is itself a
collective: the ranks must replay, capture and fall back together. So rank 0's runner decides
(`Runner.decide`), the Decision travels with the step's inputs, and every rank's runner, rank
0's too, carries it out (`Runner.follow`); a follower never decides alone.

What a rank only learns by doing it (a capture that failed, a parity mismatch, the bytes a graph
holds) is agreed after every unit of capture work (`Agreement.agree`): the worst outcome of any
rank rejects the candidate on every rank, and the largest rank's bytes are what every rank
charges, so the budget holds on every rank and the caches evict alike.

RankRunner is the GraphRunner of a rank: a single-process runner pays for none of this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from graphguard.core.capture import CaptureUnits, Verdict, next_unit
from graphguard.core.decisions import Decision, DecisionError
from graphguard.core.entry import GraphEntry
from graphguard.core.graph_runner import Args, GraphRunner
from graphguard.core.inputs import CallPlan
from graphguard.core.reasons import CaptureOutcome, FallbackReason

# Worst first: the outcome every rank takes when ranks disagree (a refusal is for good).
SEVERITY = (
    CaptureOutcome.STATE_REFUSED,
    CaptureOutcome.FAILED,
    CaptureOutcome.PARITY_MISMATCH,
    CaptureOutcome.OVER_BUDGET,
)


class RankDivergence(DecisionError):
    """A rank's runner cannot carry out its leader's decision, or the ranks disagree on how a
    capture went: their states differ."""


@dataclass(frozen=True)
class Vote:
    """One rank's view after a unit of capture work: its rejection (None: fine so far), the
    candidate's bytes, and whether its capture has ended."""

    outcome: CaptureOutcome | None
    resident_bytes: int
    is_done: bool
    refusal: FallbackReason | None = None  # with STATE_REFUSED: the named reason


class Agreement(Protocol):
    """Combines every rank's Vote into the one every rank acts on (a collective call)."""

    def agree(self, vote: Vote) -> Vote: ...


def worst_vote(votes: list[Vote]) -> Vote:
    """The agreed vote: the most severe rejection, the largest bytes; ended only if all ended
    (a RankDivergence when, with no rejection, some ended and some did not)."""
    rejected = [v for v in votes if v.outcome is not None]
    worst = min(rejected, key=lambda v: SEVERITY.index(v.outcome)) if rejected else None
    outcome = worst.outcome if worst is not None else None
    ended = {v.is_done for v in votes}
    if outcome is None and len(ended) > 1:
        raise RankDivergence("ranks disagree on whether a capture has ended")
    num_bytes = max(v.resident_bytes for v in votes)
    refusal = worst.refusal if worst is not None else None
    return Vote(outcome, num_bytes, outcome is not None or ended == {True}, refusal)


def agreed_units(units: CaptureUnits, candidate: GraphEntry, agreement: Agreement) -> CaptureUnits:
    """A capture's units, each followed by the ranks' agreement on how it went."""
    try:
        while True:
            verdict = next_unit(units)
            vote = agreement.agree(_vote(verdict, candidate.resident_bytes))
            if vote.outcome is not None:
                return _agreed_rejection(verdict, vote)
            # NOTE: every rank charges the largest rank's bytes: the budget holds on each and
            # their caches, fed the same calls, choose the same victims.
            candidate.resident_bytes = vote.resident_bytes
            if verdict is not None:
                return verdict
            yield
    finally:
        units.close()


def _vote(verdict: Verdict | None, resident_bytes: int) -> Vote:
    if verdict is None:
        return Vote(None, resident_bytes, False)
    return Vote(verdict.outcome, resident_bytes, True, verdict.refusal)


def _agreed_rejection(verdict: Verdict | None, vote: Vote) -> Verdict:
    """The rejection every rank takes. A rank that passed hands its state back to be undone;
    one that rejected alike keeps its own error and eager answer."""
    assert vote.outcome is not None
    if verdict is not None and verdict.outcome is vote.outcome:
        return replace(verdict, refusal=vote.refusal)
    error = RankDivergence(f"{vote.outcome} on another rank")
    state = verdict.state if verdict is not None else None
    if vote.outcome is CaptureOutcome.STATE_REFUSED:
        return Verdict(outcome=vote.outcome, error=error, refusal=vote.refusal, state=state)
    eager = verdict.eager if verdict is not None and verdict.outcome is not None else None
    return Verdict(outcome=vote.outcome, error=error, eager=eager, state=state)


class Orders(Protocol):
    """Where a rank's runner takes its decisions from."""

    def on_call(self, runner: GraphRunner, call: Args) -> Any: ...
    def between_calls(self, runner: GraphRunner) -> bool: ...


class LeaderOrders:
    """Rank 0: decide, send the decision to the followers, carry it out."""

    def __init__(self, send: Callable[[Decision], None]) -> None:
        self._send = send

    def on_call(self, runner: GraphRunner, call: Args) -> Any:
        decision = runner.decide(call)
        self._send(decision)
        return runner.follow(call, decision)

    def between_calls(self, runner: GraphRunner) -> bool:
        decision = runner.decide_between_calls()
        self._send(decision)
        return runner.follow_between_calls(decision)


class FollowerOrders:
    """Rank > 0: carry out the leader's decision for each call. Decisions between calls are
    the follower loop's to receive and hand to `follow_between_calls`."""

    def __init__(self, receive: Callable[[], Decision]) -> None:
        self._receive = receive

    def on_call(self, runner: GraphRunner, call: Args) -> Any:
        return runner.follow(call, self._receive())

    def between_calls(self, runner: GraphRunner) -> bool:
        raise RankDivergence("a follower's runner advances captures only on its leader's order")


class RankRunner(GraphRunner):
    """A tensor-parallel rank's GraphRunner: its calls and the work between them go through
    its orders, and the ranks agree after every unit of capture work."""

    def __init__(
        self, fn: Callable[..., Any], orders: Orders, agreement: Agreement, **options: Any
    ):
        super().__init__(fn, **options)
        self.orders = orders
        self.agreement = agreement

    def __call__(self, *args: Any) -> Any:
        return self.orders.on_call(self, args)

    def advance_capture(self) -> bool:
        return self.orders.between_calls(self)

    def _capture_units(self, candidate: GraphEntry, call: Args, plan: CallPlan) -> CaptureUnits:
        return agreed_units(
            super()._capture_units(candidate, call, plan), candidate, self.agreement
        )
