"""The runner's half of tensor parallelism: decide on the leader, follow on every rank.

RunnerBase._run decides and acts on a call under one hold of the runner's lock. Under tensor
parallelism the two halves are apart (graphguard.core.decisions): rank 0's runner decides, the
Decision travels with the step's inputs, and every rank's runner carries it out. A follower
first evicts what its leader no longer holds, so the caches stay the same; what it cannot
carry out (a key it does not hold, a capture it is not running) is a RankDivergence.

Lock order: an engine's lifecycle lock, then the runner's lock, then its cache's lock.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from dataclasses import replace
from typing import Any, Generic

from graphguard.core.cache import GraphCache
from graphguard.core.capture_flow import C, E
from graphguard.core.decisions import Action, Decision, RankDivergence
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import EvictionCause, FallbackReason


class Following(Generic[E, C]):
    """decide() / follow() of calls, and of the work between calls (see module docstring)."""

    # Set by RunnerBase.__init__.
    name: str
    _cache: GraphCache[E]
    _lock: threading.RLock
    _closed: bool

    def decide(self, call: C) -> Decision:
        """The leader's decision for `call`, made as `_run` makes it; every rank then carries
        it out with follow()."""
        reason = self._gate()
        plan = self._plan(call) if reason is None else reason
        if isinstance(plan, FallbackReason):
            return Decision.fallback(plan)
        with self._lock:
            if self._closed:
                return Decision.fallback(FallbackReason.CLOSED)
            resident = tuple(entry.key for entry in self._cache.entries())
            # the key travels with a fallback too: every rank times its eager call of the key
            return replace(self._choose(plan.key), key=plan.key, resident=resident)

    def follow(self, call: C, decision: Decision) -> Any:
        """Carry out a leader's decision for `call`; never decides alone."""
        if decision.action is Action.FALLBACK:
            assert decision.reason is not None
            return self._fallback(call, decision.reason, None, decision.key)
        plan = self._plan(call)
        if isinstance(plan, FallbackReason) or plan.key != decision.key:
            raise RankDivergence(f"{self.name}: this rank plans {plan}, the leader {decision.key}")
        with self._lock:
            for entry in self._cache.entries():
                if entry.key not in decision.resident:  # the leader evicted it
                    self._cache.evict(entry.key, EvictionCause.BUDGET)
            out, reason = self._act(call, plan, decision)
        return out if reason is None else self._fallback(call, reason, out)

    def decide_between_calls(self) -> Decision:
        """The leader's decision between calls: advance, cancel or nothing (follow_between)."""
        with self._lock:
            return self._advance_decision()

    def follow_between_calls(self, decision: Decision) -> bool:
        """Carry out a leader's decision between calls; True while a capture remains."""
        with self._lock:
            return self._advance(decision)

    # -- hooks (RunnerBase, CaptureFlow) ----------------------------------------------------
    @abstractmethod
    def _gate(self) -> FallbackReason | None: ...
    @abstractmethod
    def _plan(self, call: C) -> CallPlan | FallbackReason: ...
    @abstractmethod
    def _choose(self, key: GraphKey) -> Decision: ...
    @abstractmethod
    def _act(
        self, call: C, plan: CallPlan, decision: Decision
    ) -> tuple[Any, FallbackReason | None]: ...
    @abstractmethod
    def _fallback(
        self, call: C, reason: FallbackReason, out: Any, key: GraphKey | None = None
    ) -> Any: ...
    @abstractmethod
    def _advance_decision(self) -> Decision: ...
    @abstractmethod
    def _advance(self, decision: Decision) -> bool: ...
