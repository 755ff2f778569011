"""SingleGraphs: the kind of a GraphRunner (graphguard.core.kind): one graph per key, keyed by
the call's padded arguments. Planning a call into a bucketed key, copying its inputs into an
entry's static inputs and slicing the outputs back, capturing an entry (with the record run that
finds the step's state, graphguard/core/state.py) and checking its first replay against eager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from graphguard.core.backends import Backend, CaptureError
from graphguard.core.capture import CaptureMode, CaptureUnits, Verdict
from graphguard.core.entry import GraphEntry
from graphguard.core.inputs import (
    MAX_PLANS,
    CallPlan,
    call_signature,
    copy_inputs,
    make_static_args,
    padding_example,
    plan_call,
    slice_outputs,
)
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.kind import Replayed
from graphguard.core.options import CaptureConfig
from graphguard.core.pystate import PyChanges
from graphguard.core.reasons import CaptureOutcome, FallbackReason
from graphguard.core.state import (
    PythonState,
    Recorded,
    StateOptions,
    StateRefused,
    StepState,
    watch_step,
)
from graphguard.core.verify import (
    ParityError,
    VerifyConfig,
    max_abs_diffs,
    parity_error,
    spread_error,
)

log = logging.getLogger("graphguard")

Args = tuple[Any, ...]  # one call's arguments


class SingleGraphs:
    """The kind of a GraphRunner: `fn`'s graphs, one per key (graphguard.core.kind)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        buckets: Buckets | None,
        backend: Backend | None,
        verify: VerifyConfig,
        options: CaptureConfig,
        name: str,
    ):
        self.fn = fn
        self.name = name
        self.buckets = buckets
        self.backend = backend
        self.verify = verify
        self.owners, self.options = options.owners_apart()
        declared = None if options.state is None else tuple(options.state)
        self._state = StateOptions(options.max_state_bytes, declared, tuple(options.unwatched))
        self._device = backend.device if backend is not None else torch.device("cpu")
        # NOTE: planning a call is the largest host cost of a replay; a plan depends only on
        # the call's signature and the runner's fixed settings, so it is remembered (bounded).
        self._plans: dict[tuple[Any, ...], CallPlan | FallbackReason] = {}

    def plan(self, args: Args) -> CallPlan | FallbackReason:
        """plan_call, remembered by the arguments' shapes, dtypes, devices and constants."""
        staged = self.options.stage_host_inputs
        try:
            signature = call_signature(args)
            plan = self._plans.get(signature)
        except TypeError:  # an unhashable constant: plan_call names the reason
            return plan_call(args, self.buckets, self._device, staged)
        if plan is None:
            plan = plan_call(args, self.buckets, self._device, staged)
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[signature] = plan
        return plan

    def eager(self, args: Args) -> Any:
        return self.fn(*args)

    def example(self, key: GraphKey) -> tuple[Args, CallPlan]:
        examples = self.options.examples
        args = tuple(examples(key)) if examples else padding_example(key, self.buckets)
        plan = self.plan(args)
        if isinstance(plan, FallbackReason) or plan.key != key:
            raise ValueError(f"example inputs of {key.describe()} do not map to that key")
        return args, CallPlan(key, key.rows)  # every row counts: nothing is sliced off

    def new_candidate(self, key: GraphKey) -> GraphEntry:
        assert self.backend is not None
        return GraphEntry(key, self.backend)

    def capture(self, entry: GraphEntry, args: Args, plan: CallPlan) -> CaptureUnits:
        """Units: the static inputs, the record run (one eager execution, watched for the
        step's state: graphguard/core/state.py) and the first warm-up; each further warm-up;
        the capture; the first replay and its check against the record run, outputs and
        state. Between units the state is as the call found it."""
        try:
            for owner in self.owners:
                entry.retain(owner)
            static_args = make_static_args(entry, args, plan, self.buckets)
            recorded = self._record(entry)
        except CaptureError as exc:
            refused = exc.__cause__
            if isinstance(refused, PythonState):  # the record run stands as the call's run
                return Verdict.refused(refused, slice_outputs(refused.outputs, plan, copy=True))
            if isinstance(refused, StateRefused):  # undone: the call runs as if nothing ran
                return Verdict.refused(refused)
            return Verdict.rejected(CaptureOutcome.FAILED, exc)
        state = recorded.state
        state.undo()
        entry.transient_bytes = state.num_bytes
        try:
            if self.verify.mode == "spread":
                entry.eager_spread = self._spread(entry, recorded)
            yield from self._warm_and_capture(entry, static_args, recorded)
            yield
            outputs = entry.replay()
            state.written()
        except Exception as exc:  # noqa: BLE001 - a failed warm-up, capture or first replay
            # NOTE: it may have run part of the step (a warm-up, the simulation's capture, a
            # replay up to a hole that failed): put back what the record run wrote
            state.written()
            state.undo()
            return Verdict.rejected(CaptureOutcome.FAILED, exc)
        finally:
            entry.transient_bytes = 0
        changed = self._python_differs(entry, recorded)
        if changed is not None:  # what the replay changed, and what eager did, go back
            changed.undo()
            state.undo()
            why = recorded.python_error(changed)
            return Verdict.refused(StateRefused(FallbackReason.PYTHON_STATE, why))
        error = self._check(entry, outputs, recorded, state)
        if error is not None:
            state.undo()
            return Verdict.rejected(CaptureOutcome.PARITY_MISMATCH, error)
        entry.verified = self.verify.mode  # the check it passed: "off" when none ran
        return Verdict(outputs, state=None if state.is_empty else state)

    def _record(self, entry: GraphEntry) -> Recorded:
        """The record run, as a warm-up: on the entry's stream, allocating in its pool (its
        blocks are those the warm-ups and the capture reuse), a failure a CaptureError whose
        cause says why."""
        found: list[Recorded] = []

        def record(*static_args: Any) -> None:
            found.append(watch_step(self.fn, static_args, entry.backend.device, self._state))

        entry.warm_up(record)
        return found[0]

    def _warm_and_capture(
        self, entry: GraphEntry, static_args: list[Any], recorded: Recorded
    ) -> CaptureUnits:
        """The warm-ups, each undone, then the capture (which runs nothing but the holes)."""
        state = recorded.state
        for _ in range(entry.backend.num_warmup):
            entry.warm_up(self.fn)
            state.written()
            state.undo()
            yield
        entry.capture(self.fn, static_args, recorded.holes.calls)
        # NOTE: a CUDA capture runs nothing; the simulation's runs the step once: undone too
        state.written()
        state.undo()
        return Verdict()

    def _python_differs(self, entry: GraphEntry, recorded: Recorded) -> PyChanges | None:
        """What a replay changed of the Python-side values, where that is not what the record
        run changed (only a step with holes, or Python-side changes, can differ: one without
        either changed nothing, and one with changes but no holes was refused after its record
        run)."""
        if not recorded.state.python and not recorded.holes.calls:
            return None
        return recorded.python_differs((self.fn, *entry.static_args), self._state.unwatched)

    def _check(
        self, entry: GraphEntry, outputs: Any, recorded: Recorded, state: StepState
    ) -> ParityError | None:
        """The first replay against the record run: its outputs, then what it wrote.

        NOTE: eager ran on the padded static inputs, so it does not answer the call."""
        if not self.verify.enabled:
            return None
        if self.verify.mode == "spread":
            assert entry.eager_spread is not None
            graph, eager = (outputs, state.regions()), (recorded.outputs, recorded.after)
            entry.graph_error = max_abs_diffs(graph, eager)
            return spread_error(entry.key, graph, eager, entry.eager_spread)
        error = parity_error(entry.key, outputs, recorded.outputs, self.verify)
        if error is None and state.writes:
            error = parity_error(entry.key, state.regions(), recorded.after, self.verify)
            if error is not None:
                error = ParityError(f"the state it wrote differs from eager's: {error}")
        return error

    def _spread(self, entry: GraphEntry, recorded: Recorded) -> list[float]:
        """verify="spread": eager once more from the same state (as a warm-up, then undone);
        how far its outputs and writes land from the record run's, per leaf."""
        state, found = recorded.state, []

        def again(*static_args: Any) -> None:
            outputs = self.fn(*static_args)
            state.written()
            found.append(
                max_abs_diffs((outputs, state.regions()), (recorded.outputs, recorded.after))
            )
            state.undo()

        entry.warm_up(again)
        return found[0]

    def replay(self, entry: GraphEntry, args: Args, plan: CallPlan) -> Replayed:
        every = self.verify.reverify_every
        if every and self.verify.enabled and (entry.replays + 1) % every == 0:
            return self._reverified(entry, args, plan)
        outputs = entry.replay(lambda: copy_inputs(entry, args, plan, self.buckets))
        return Replayed(slice_outputs(outputs, plan, self.options.copy_outputs))

    def _reverified(self, entry: GraphEntry, args: Args, plan: CallPlan) -> Replayed:
        """A replay checked against eager: a watched eager run first (its writes undone),
        then the replay, compared as at admission."""
        copy_inputs(entry, args, plan, self.buckets)
        try:
            recorded = watch_step(self.fn, entry.static_args, entry.backend.device, self._state)
        except PythonState as refused:  # the watched run stands as the call's execution
            answer = slice_outputs(refused.outputs, plan, copy=True)
            return Replayed(answer, FallbackReason.PARITY_MISMATCH, drift=refused)
        except StateRefused as refused:  # undone: the call runs eagerly
            return Replayed(None, FallbackReason.PARITY_MISMATCH, drift=refused)
        recorded.state.undo()
        outputs = entry.replay()
        recorded.state.written()
        changed = self._python_differs(entry, recorded)
        if changed is not None:  # both put back: the call runs eagerly
            changed.undo()
            recorded.state.undo()
            drift = ParityError(recorded.python_error(changed))
            return Replayed(None, FallbackReason.PARITY_MISMATCH, drift=drift)
        error = self._check(entry, outputs, recorded, recorded.state)
        if error is not None:
            # the replay's writes stand in for eager's; the answer is eager's
            eager = tree_map(lambda t: t.to(self._device) if isinstance(t, Tensor) else t,
                             recorded.outputs)  # fmt: skip
            return Replayed(slice_outputs(eager, plan, copy=False), drift=error,
                            reason=FallbackReason.PARITY_MISMATCH)  # fmt: skip
        return Replayed(slice_outputs(outputs, plan, self.options.copy_outputs))

    def admitted(self, entry: GraphEntry, outputs: Any, plan: CallPlan, mode: CaptureMode) -> Any:
        log.info(
            "graphguard capture key=%s bytes=%d ms=%.1f runner=%s",
            entry.key.describe(), entry.resident_bytes, entry.capture_ms, self.name,
        )  # fmt: skip
        if mode is not CaptureMode.ON_CALL:
            return None
        return slice_outputs(outputs, plan, self.options.copy_outputs)

    def cover(self, key: GraphKey, is_admitted: Callable[[GraphKey], bool]) -> GraphKey | None:
        """The smallest admitted larger bucket of `key` within max_pad_factor."""
        rows, factor = key.rows, self.options.max_pad_factor
        if factor == 1 or self.buckets is None or rows is None:
            return None
        for size in self.buckets.batch:
            if size > rows * factor:
                break
            if size > rows and is_admitted(bigger := key.with_rows(size)):
                return bigger
        return None

    def num_graphs(self, entry: GraphEntry) -> int:
        return 1
