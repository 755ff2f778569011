"""SegmentedRunner: a pipeline whose capturable segments replay from graphs, per shape key, and
SegmentGroups, its kind.

A call's key is the spec of its input carry. The first time a key earns a capture (the
AdmissionPolicy decides, as for GraphRunner) every segment is captured into one SegmentGroup
while the eager stages run between them; the group's output is compared with the whole
pipeline run eagerly (exact by default) before the group is admitted, and the group is charged,
kept and evicted as a unit under the byte budget (GraphCache). Every call either replays a
group or runs eagerly with exactly one FallbackReason; GRAPHGUARD_DISABLE=1 beats everything.
That call flow is the Runner's (graphguard.core.runner); this module is the kind for groups.

Lock order: an engine's lifecycle lock, then this runner's lock, then its cache's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import Backend, CaptureError
from graphguard.core.capture import CaptureMode, CaptureUnits, Verdict
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.kind import Replayed
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.reasons import CaptureOutcome, FallbackReason
from graphguard.core.runner import Clock, Runner
from graphguard.core.switch import resolve_backend
from graphguard.core.verify import VerifyConfig, parity_error
from graphguard.segmented.group import (
    GroupInfo,
    GroupOverBudget,
    SegmentGroup,
    capture_group,
    carry_key,
    replay_group,
)
from graphguard.segmented.pipeline import Carry, Piece, Segment, Stage, run_eager, split_segments

log = logging.getLogger("graphguard")

Call = tuple[Carry, Any]  # one call: the input carry, and the context of the eager stages


class SegmentGroups:
    """The kind of a SegmentedRunner: one group of segment graphs per key."""

    def __init__(
        self,
        pieces: Sequence[Piece],
        backend: Backend | None,
        verify: VerifyConfig,
        options: CaptureConfig,
        max_bytes: int,
        name: str,
        context_key: Callable[[Any], Hashable] | None = None,
        fallback: Callable[[Call], Carry] | None = None,
    ):
        self.pieces = pieces
        self.context_key = context_key
        self.fallback = fallback
        self.backend = backend
        self.verify = verify
        self.owners, self.options = options.owners_apart()
        self.max_bytes = max_bytes
        self.name = name

    def plan(self, call: Call) -> CallPlan | FallbackReason:
        """The carry's exact specs are the key (no buckets: rows are not padded), with what
        `context_key` reads from the call's context."""
        carry, context = call
        assert self.backend is not None
        for value in carry:
            if not isinstance(value, Tensor):
                return FallbackReason.UNSUPPORTED_INPUT
            if value.device != self.backend.device:
                return FallbackReason.DEVICE_MISMATCH
        key = carry_key(carry)
        if self.context_key is not None:
            key = GraphKey((*key.args, self.context_key(context)))
        return CallPlan(key, None)

    def eager(self, call: Call) -> Carry:
        if self.fallback is not None:
            return self.fallback(call)
        return run_eager(self.pieces, *call)

    def example(self, key: GraphKey) -> tuple[Call, CallPlan]:
        assert self.options.examples is not None  # checked when built
        carry, context = self.options.examples(key)
        if carry_key(tuple(carry)) != key:
            raise ValueError(f"example inputs of {key.describe()} do not map to that key")
        return (tuple(carry), context), CallPlan(key, None)

    def new_candidate(self, key: GraphKey) -> SegmentGroup:
        assert self.backend is not None
        return SegmentGroup(key, self.backend, self.name)

    def capture(self, group: SegmentGroup, call: Call, plan: CallPlan) -> CaptureUnits:
        """Capture every segment (eager stages between), then compare with the whole pipeline
        run eagerly (one more unit); that eager run answers the call if the group is not
        admitted."""
        carry, context = call
        try:
            out = yield from capture_group(
                group, self.pieces, carry, context, self.owners, self.max_bytes
            )
        except CaptureError as exc:
            return Verdict.rejected(CaptureOutcome.FAILED, exc)
        except GroupOverBudget:
            return Verdict.rejected(CaptureOutcome.OVER_BUDGET)
        if not self.verify.enabled:
            return Verdict(out)
        eager = run_eager(self.pieces, carry, context)
        error = parity_error(group.key, out, eager, self.verify)
        if error is not None:
            return Verdict.rejected(CaptureOutcome.PARITY_MISMATCH, error, eager)
        return Verdict(out, eager)

    def replay(self, group: SegmentGroup, call: Call, plan: CallPlan) -> Replayed:
        out, is_complete = replay_group(group, self.pieces, *call)
        if not is_complete:
            # An eager stage changed a shape the key did not predict; the tail ran eagerly.
            return Replayed(out, FallbackReason.UNBUCKETED_SHAPE)
        group.replays += 1
        return Replayed(self._finish(out))

    def _finish(self, carry: Carry) -> Carry:
        # NOTE: copy even after an eager last stage: it may pass a segment's static output
        # through, which the next replay would overwrite.
        return tuple(t.clone() for t in carry) if self.options.copy_outputs else carry

    def admitted(
        self, group: SegmentGroup, out: Carry, plan: CallPlan, mode: CaptureMode
    ) -> Carry | None:
        group.mark_admitted(self.verify.mode if self.verify.enabled else "off")
        log.info(
            "graphguard capture group key=%s segments=%d bytes=%d ms=%.1f runner=%s",
            group.key.describe(), len(group.entries), group.resident_bytes, group.capture_ms,
            self.name,
        )  # fmt: skip
        if mode is not CaptureMode.ON_CALL:
            return None
        group.replays += 1  # the verified first replay serves this call
        return self._finish(out)

    def cover(self, key: GraphKey, is_admitted: Callable[[GraphKey], bool]) -> GraphKey | None:
        return None  # no buckets: a group serves its own carry's shapes only

    def num_graphs(self, group: SegmentGroup) -> int:
        return len(group.entries)


class SegmentedRunner(Runner[SegmentGroup, Call]):
    """Runs `stages` with graphed segments and eager stages between them.

    Args:
        stages: the pipeline in order; consecutive capturable stages form one segment.
        max_bytes: resident byte budget for all groups of this runner.
        verify: "exact" (bitwise), "off", or a VerifyConfig ("allclose" with rtol and atol).
        admission: when a key earns a capture (AdmissionConfig), as for GraphRunner.
        capture: as for GraphRunner (CaptureConfig); a capture between calls (`background`)
            needs `examples(key)` -> (input carry, context): inputs whose eager stages write
            only state that no real call reads. Padding to a larger bucket and host staging
            do not apply.
        backend: "auto" (CUDA when present, else eager with no_cuda), "cuda", "sim" or a Backend.
        metrics: a GraphMetrics to report into (shared across runners), or a private one.
        clock: time source of every admission decision.
        name: the runner's name in logs, metrics and stats.
        context_key: what of a call's context selects its segments' Python path, part of each
            group's key (a transformers model's active adapters); None: the carry alone.
        fallback: answers a call that replays no group, `fallback((inputs, context))`, instead
            of the pipeline run eagerly: another way to the same output carry (the engine's
            whole prefill graphs fall back to its prefill segments). Timed as the eager call
            is, so the payback rule weighs a capture against it; the parity check still runs
            the pipeline eagerly.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        max_bytes: int = 1 << 30,
        verify: str | VerifyConfig = "exact",
        admission: AdmissionConfig | None = None,
        capture: CaptureConfig | None = None,
        backend: str | Backend = "auto",
        metrics: GraphMetrics | None = None,
        clock: Clock = time.monotonic,
        name: str = "segmented",
        context_key: Callable[[Any], Hashable] | None = None,
        fallback: Callable[[Call], Carry] | None = None,
    ):
        capture = capture or CaptureConfig()
        if capture.background and capture.examples is None:
            raise ValueError("background capture runs on example inputs: give examples(key)")
        if capture.max_pad_factor != 1 or capture.stage_host_inputs:
            raise ValueError("a SegmentedRunner neither pads to larger buckets nor stages inputs")
        verify = verify if isinstance(verify, VerifyConfig) else VerifyConfig(verify)
        resolved = resolve_backend(backend, capture.device)
        pieces = split_segments(stages)
        kind = SegmentGroups(
            pieces, resolved, verify, capture, max_bytes, name, context_key, fallback
        )
        super().__init__(
            kind, backend=resolved, max_bytes=max_bytes, admission=admission, capture=kind.options,
            metrics=metrics, clock=clock, name=name,
        )  # fmt: skip
        self.kind: SegmentGroups = kind
        self.pieces = pieces
        self.num_segments = sum(isinstance(p, Segment) for p in pieces)

    def __call__(self, inputs: Sequence[Tensor], context: Any = None) -> Carry:
        """The pipeline's output carry for `inputs`; `context` goes to the eager stages only."""
        return self.run((tuple(inputs), context))

    def eager(self, inputs: Sequence[Tensor], context: Any = None) -> Carry:
        """The whole pipeline without graphs (the parity reference)."""
        return run_eager(self.pieces, tuple(inputs), context)

    def groups(self) -> list[SegmentGroup]:
        """The admitted groups, least recently used first."""
        return self._cache.entries()

    def group_infos(self) -> list[GroupInfo]:
        return [group.info() for group in self.groups()]

    def stats(self) -> dict[str, Any]:
        """A snapshot: counts, bytes, fallbacks by reason, admission counters."""
        with self._lock:
            groups = self.groups()
            stats = super().stats()
            stats.update(
                num_segments=self.num_segments,
                groups=len(groups),
                graphs=sum(len(g.entries) for g in groups),
            )
            return stats
