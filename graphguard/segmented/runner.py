"""SegmentedRunner: a pipeline whose capturable segments replay from graphs, per shape key.

A call's key is the spec of its input carry. The first time a key earns a capture (the
AdmissionPolicy decides, as for GraphRunner) every segment is captured into one SegmentGroup
while the eager stages run between them; the group's output is compared with the whole
pipeline run eagerly (exact by default) before the group is admitted, and the group is charged,
kept and evicted as a unit under the byte budget (GraphCache). Every call either replays a
group or runs eagerly with exactly one FallbackReason; GRAPHGUARD_DISABLE=1 beats everything.

Lock order: an engine's lifecycle lock, then this runner's lock, then its cache's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from torch import Tensor

from graphguard.core.admission import AdmissionConfig, Clock
from graphguard.core.backends import Backend, CaptureError
from graphguard.core.base import RunnerBase
from graphguard.core.entry import GraphEntry
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import CaptureOutcome, FallbackReason
from graphguard.core.verify import VerifyConfig
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


class SegmentedRunner(RunnerBase):
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
    ):
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
        )
        self.pieces = split_segments(stages)
        self.num_segments = sum(isinstance(p, Segment) for p in self.pieces)

    # -- the call --------------------------------------------------------------------------
    def __call__(self, inputs: Sequence[Tensor], context: Any = None) -> Carry:
        """The pipeline's output carry for `inputs`; `context` goes to the eager stages only."""
        carry = tuple(inputs)
        reason = self._gate() or self._check_inputs(carry)
        out: Carry | None = None
        if reason is None:
            with self._lock:
                if self._closed:
                    reason = FallbackReason.CLOSED
                else:
                    out, reason = self._serve(carry, context)
                    if reason is None:
                        assert out is not None
                        return out
        assert reason is not None
        return self._fallback(carry, context, reason, out)

    def eager(self, inputs: Sequence[Tensor], context: Any = None) -> Carry:
        """The whole pipeline without graphs (the parity reference)."""
        return run_eager(self.pieces, tuple(inputs), context)

    def _check_inputs(self, carry: Carry) -> FallbackReason | None:
        assert self.backend is not None
        for value in carry:
            if not isinstance(value, Tensor):
                return FallbackReason.UNSUPPORTED_INPUT
            if value.device != self.backend.device:
                return FallbackReason.DEVICE_MISMATCH
        return None

    def _serve(self, carry: Carry, context: Any) -> tuple[Carry | None, FallbackReason | None]:
        key = carry_key(carry)
        self.policy.record_call(key)
        with self._cache.pinned(key) as found:
            if found is not None:
                return self._replay(cast(SegmentGroup, found), carry, context)
        reason = self._admission_reason(key)
        if reason is not None:
            return None, reason
        return self._capture(key, carry, context)

    def _fallback(
        self, carry: Carry, context: Any, reason: FallbackReason, out: Carry | None
    ) -> Carry:
        self._count_fallback(reason)
        # A rejected capture already ran the pipeline eagerly for its parity check: reuse it.
        return out if out is not None else run_eager(self.pieces, carry, context)

    # -- replay ----------------------------------------------------------------------------
    def _replay(
        self, group: SegmentGroup, carry: Carry, context: Any
    ) -> tuple[Carry | None, FallbackReason | None]:
        out, is_complete = replay_group(group, self.pieces, carry, context)
        if not is_complete:
            # An eager stage changed a shape the key did not predict; the tail ran eagerly.
            return out, FallbackReason.UNBUCKETED_SHAPE
        group.replays += 1
        self._count_replay()
        return self._finish(out), None

    def _finish(self, carry: Carry) -> Carry:
        # NOTE: copy even after an eager last stage: it may pass a segment's static output
        # through, which the next replay would overwrite.
        return tuple(t.clone() for t in carry) if self.copy_outputs else carry

    # -- capture ---------------------------------------------------------------------------
    def _capture(
        self, key: GraphKey, carry: Carry, context: Any
    ) -> tuple[Carry | None, FallbackReason | None]:
        self._cache.make_room(self._expected_bytes(key))  # before the capture, as GraphRunner
        started = self.clock()
        assert self.backend is not None
        group = SegmentGroup(key, self.backend, self.name)
        try:
            out = capture_group(
                group, self.pieces, carry, context, self._owners, self._cache.max_bytes
            )
        except CaptureError as exc:
            failed = CaptureOutcome.FAILED
            return None, self._reject(group, failed, FallbackReason.CAPTURE_FAILED, exc)
        except GroupOverBudget:
            self.policy.size_hints[key] = group.resident_bytes
            over = CaptureOutcome.OVER_BUDGET
            return None, self._reject(group, over, FallbackReason.OVER_BUDGET, None)
        except BaseException:
            group.retire()  # an eager stage raised mid-capture: release the partial group
            raise
        eager = None
        if self.verify.enabled:
            eager = run_eager(self.pieces, carry, context)
            error = self._parity_error(key, out, eager)
            if error is not None:
                mismatch = FallbackReason.PARITY_MISMATCH
                outcome = CaptureOutcome.PARITY_MISMATCH
                return eager, self._reject(group, outcome, mismatch, error)
        return self._admit(group, out, eager, self.clock() - started)

    def _admit(
        self, group: SegmentGroup, out: Carry, eager: Carry | None, seconds: float
    ) -> tuple[Carry | None, FallbackReason | None]:
        key = group.key
        self._count_capture(key, seconds, group.resident_bytes)
        if not self._cache.admit(cast(GraphEntry, group)):
            over = CaptureOutcome.OVER_BUDGET
            return eager, self._reject(group, over, FallbackReason.OVER_BUDGET, None)
        group.mark_admitted(self.verify.mode if self.verify.enabled else "off")
        group.replays += 1  # the verified first replay serves this call
        self._count_admitted()
        log.info(
            "graphguard capture group key=%s segments=%d bytes=%d ms=%.1f runner=%s",
            key.describe(),
            len(group.entries),
            group.resident_bytes,
            group.capture_ms,
            self.name,
        )
        return self._finish(out), None

    def groups(self) -> list[SegmentGroup]:
        """The admitted groups, least recently used first."""
        return [cast(SegmentGroup, g) for g in self._cache.entries()]

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
