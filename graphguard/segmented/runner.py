"""SegmentedRunner: a pipeline whose capturable segments replay from graphs, per shape key.

A call's key is the spec of its input carry. The first time a key earns a capture (the
AdmissionPolicy decides, as for GraphRunner) every segment is captured into one SegmentGroup
while the eager stages run between them; the group's output is compared with the whole
pipeline run eagerly (exact by default) before the group is admitted, and the group is charged,
kept and evicted as a unit under the byte budget (GraphCache). Every call either replays a
group or runs eagerly with exactly one FallbackReason; GRAPHGUARD_DISABLE=1 beats everything.
That call flow is RunnerBase's; this module implements its hooks for groups.

Lock order: an engine's lifecycle lock, then this runner's lock, then its cache's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from graphguard.core.admission import AdmissionConfig, Clock
from graphguard.core.backends import Backend, CaptureError
from graphguard.core.background import CaptureUnits
from graphguard.core.base import RunnerBase
from graphguard.core.capture_flow import CaptureMode, Verified
from graphguard.core.inputs import CallPlan
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import CaptureOutcome, FallbackReason
from graphguard.core.verify import VerifyConfig, parity_error
from graphguard.segmented.group import (
    GroupInfo,
    GroupOverBudget,
    SegmentGroup,
    capture_group,
    carry_key,
    replay_group,
)
from graphguard.segmented.pipeline import Carry, Segment, Stage, run_eager, split_segments

log = logging.getLogger("graphguard")

Call = tuple[Carry, Any]  # one call: the input carry, and the context of the eager stages


class SegmentedRunner(RunnerBase[SegmentGroup, Call]):
    """Runs `stages` with graphed segments and eager stages between them.

    Args:
        stages: the pipeline in order; consecutive capturable stages form one segment.
        max_bytes: resident byte budget for all groups of this runner.
        verify: "exact" (bitwise), "allclose" (with rtol and atol) or "off".
        backend: "auto" (CUDA when present, else eager with no_cuda), "cuda", "sim" or a Backend.
        admission: when a key earns a capture (AdmissionConfig), as for GraphRunner.
        strict: re-raise capture failures and parity mismatches instead of falling back.
        copy_outputs: return copies (True) or views of the last segment's static outputs,
            valid until the next call (False).
        retain: objects every segment graph keeps alive while it can replay.
        metrics: a GraphMetrics to report into (shared across runners), or a private one.
        clock: time source of every admission decision.
        background: capture between calls (advance_capture), as for GraphRunner; needs
            `examples`.
        examples: `examples(key)` -> (input carry, context) of a key, for a capture between
            calls: inputs whose eager stages write only state that no real call reads.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        max_bytes: int = 1 << 30,
        verify: str = "exact",
        rtol: float | None = None,
        atol: float | None = None,
        backend: str | Backend = "auto",
        device: Any = None,
        admission: AdmissionConfig | None = None,
        strict: bool = False,
        copy_outputs: bool = True,
        retain: Sequence[Any] = (),
        metrics: GraphMetrics | None = None,
        clock: Clock = time.monotonic,
        name: str = "segmented",
        enabled: bool = True,
        background: bool = False,
        examples: Callable[[GraphKey], Call] | None = None,
    ):
        if background and examples is None:
            raise ValueError("background capture runs on example inputs: give examples(key)")
        super().__init__(
            name=name,
            max_bytes=max_bytes,
            verify=VerifyConfig(verify, rtol, atol),
            backend=backend,
            device=device,
            admission=admission,
            strict=strict,
            copy_outputs=copy_outputs,
            retain=retain,
            metrics=metrics,
            clock=clock,
            enabled=enabled,
            background=background,
        )
        self.examples = examples
        self.pieces = split_segments(stages)
        self.num_segments = sum(isinstance(p, Segment) for p in self.pieces)

    # -- the call (RunnerBase._run is the flow; the hooks follow) ---------------------------
    def __call__(self, inputs: Sequence[Tensor], context: Any = None) -> Carry:
        """The pipeline's output carry for `inputs`; `context` goes to the eager stages only."""
        return self._run((tuple(inputs), context))

    def eager(self, inputs: Sequence[Tensor], context: Any = None) -> Carry:
        """The whole pipeline without graphs (the parity reference)."""
        return run_eager(self.pieces, tuple(inputs), context)

    def _plan(self, call: Call) -> CallPlan | FallbackReason:
        """The carry's exact specs are the key (no buckets: rows are not padded)."""
        carry, _ = call
        assert self.backend is not None
        for value in carry:
            if not isinstance(value, Tensor):
                return FallbackReason.UNSUPPORTED_INPUT
            if value.device != self.backend.device:
                return FallbackReason.DEVICE_MISMATCH
        return CallPlan(carry_key(carry), None)

    def _eager(self, call: Call) -> Carry:
        return run_eager(self.pieces, *call)

    def _example(self, key: GraphKey) -> tuple[Call, CallPlan]:
        assert self.examples is not None  # checked when built
        carry, context = self.examples(key)
        if carry_key(tuple(carry)) != key:
            raise ValueError(f"example inputs of {key.describe()} do not map to that key")
        return (tuple(carry), context), CallPlan(key, None)

    def _replay(
        self, group: SegmentGroup, call: Call, plan: CallPlan
    ) -> tuple[Carry | None, FallbackReason | None]:
        out, is_complete = replay_group(group, self.pieces, *call)
        if not is_complete:
            # An eager stage changed a shape the key did not predict; the tail ran eagerly.
            return out, FallbackReason.UNBUCKETED_SHAPE
        group.replays += 1
        self._counts.replay()
        return self._finish(out), None

    def _finish(self, carry: Carry) -> Carry:
        # NOTE: copy even after an eager last stage: it may pass a segment's static output
        # through, which the next replay would overwrite.
        return tuple(t.clone() for t in carry) if self.copy_outputs else carry

    def _new_candidate(self, key: GraphKey) -> SegmentGroup:
        assert self.backend is not None
        return SegmentGroup(key, self.backend, self.name)

    def _capture_verified(
        self, group: SegmentGroup, call: Call, plan: CallPlan
    ) -> CaptureUnits[Verified]:
        """Capture every segment (eager stages between), then compare with the whole pipeline
        run eagerly (one more unit); that eager run answers the call if the group is not
        admitted."""
        carry, context = call
        try:
            out = yield from capture_group(
                group, self.pieces, carry, context, self._owners, self.max_bytes
            )
        except CaptureError as exc:
            return None, None, self._reject(group, CaptureOutcome.FAILED, exc)
        except GroupOverBudget:
            self.policy.size_hints[group.key] = group.resident_bytes
            return None, None, self._reject(group, CaptureOutcome.OVER_BUDGET, None)
        if not self.verify.enabled:
            return out, None, None
        eager = run_eager(self.pieces, carry, context)
        error = parity_error(group.key, out, eager, self.verify)
        if error is not None:
            return None, eager, self._reject(group, CaptureOutcome.PARITY_MISMATCH, error)
        return out, eager, None

    def _admitted(
        self, group: SegmentGroup, out: Carry, plan: CallPlan, mode: CaptureMode
    ) -> Carry | None:
        group.mark_admitted(self.verify.mode if self.verify.enabled else "off")
        log.info(
            "graphguard capture group key=%s segments=%d bytes=%d ms=%.1f runner=%s",
            group.key.describe(),
            len(group.entries),
            group.resident_bytes,
            group.capture_ms,
            self.name,
        )
        if mode is not CaptureMode.ON_CALL:
            return None
        group.replays += 1  # the verified first replay serves this call
        return self._finish(out)

    # -- introspection ---------------------------------------------------------------------
    def groups(self) -> list[SegmentGroup]:
        """The admitted groups, least recently used first."""
        return self._cache.entries()

    def group_infos(self) -> list[GroupInfo]:
        return [group.info() for group in self.groups()]

    def stats(self) -> dict[str, Any]:
        """A snapshot: counts, bytes, fallbacks by reason, admission counters."""
        with self._lock:
            groups = self.groups()
            stats = self._base_stats()
            stats.update(
                num_segments=self.num_segments,
                groups=len(groups),
                graphs=sum(len(g.entries) for g in groups),
            )
            return stats

    def _num_graphs(self) -> int:
        return sum(len(g.entries) for g in self.groups())
