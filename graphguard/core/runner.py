"""GraphRunner: the public callable.

Every call either replays an admitted graph or runs eagerly with exactly one FallbackReason.
Replays of one runner are serialized by the runner's lock (lock order: engine lifecycle lock,
then this runner's lock, then its cache's lock).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from graphguard.core.admission import AdmissionConfig, Clock
from graphguard.core.backends import Backend, CaptureError
from graphguard.core.base import (
    KILL_SWITCH_ENV,
    ParityError,
    RunnerBase,
    RunnerStats,
    kill_switch_on,
    resolve_backend,
)
from graphguard.core.entry import EntryInfo, GraphEntry
from graphguard.core.inputs import (
    MAX_PLANS,
    CallPlan,
    call_signature,
    copy_inputs,
    make_static_args,
    plan_call,
    slice_outputs,
)
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import CaptureOutcome, EvictionCause, FallbackReason
from graphguard.core.verify import VerifyConfig

log = logging.getLogger("graphguard")

__all__ = [
    "KILL_SWITCH_ENV",
    "GraphRunner",
    "ParityError",
    "RunnerStats",
    "WarmupReport",
    "kill_switch_on",
    "resolve_backend",
]


@dataclass
class WarmupReport:
    captured: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # key -> reason
    seconds: float = 0.0


class GraphRunner(RunnerBase):
    """Replays CUDA graphs of `fn` under a byte budget, verified against eager.

    Args:
        fn: callable on tensors (and hashable constants) returning a tensor, tuple, list or dict
            of tensors. It must not depend on host-side state that changes between calls.
        buckets: pad dimension 0 of every tensor argument up to a bucket and slice outputs back;
            without it, graphs are keyed by exact shapes, dtypes and devices.
        max_bytes: resident byte budget for all graphs of this runner.
        verify: "exact" (bitwise), "allclose" (with rtol and atol) or "off".
        reverify_every: compare every N-th replay with eager too (0: only at admission).
        backend: "auto" (CUDA when present, else eager with no_cuda), "cuda", "sim" or a Backend.
        admission: when a key earns a capture (AdmissionConfig).
        strict: re-raise capture failures and parity mismatches instead of falling back.
        copy_outputs: return copies (True) or views of the static outputs, valid until the next
            call of this runner (False).
        stage_host_inputs: accept CPU tensors for a CUDA graph, copied through pinned buffers.
        retain: objects each graph keeps alive while it can replay (weights, KV storage).
        metrics: a GraphMetrics to report into (shared across runners), or a private one.
        clock: time source of every admission decision (tests inject a fake one).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        buckets: Buckets | None = None,
        max_bytes: int = 1 << 30,
        verify: str = "exact",
        rtol: float | None = None,
        atol: float | None = None,
        reverify_every: int = 0,
        backend: str | Backend = "auto",
        device: Any = None,
        admission: AdmissionConfig | None = None,
        strict: bool = False,
        copy_outputs: bool = True,
        stage_host_inputs: bool = False,
        retain: Sequence[Any] = (),
        metrics: GraphMetrics | None = None,
        clock: Clock = time.monotonic,
        name: str = "graph",
        enabled: bool = True,
    ):
        super().__init__(
            name=name,
            max_bytes=max_bytes,
            verify=VerifyConfig(verify, rtol, atol, reverify_every),
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
        self.fn = fn
        self.buckets = buckets
        self.stage_host_inputs = stage_host_inputs
        # NOTE: planning a call is the largest host cost of a replay; a plan depends only on
        # the call's signature and the runner's fixed settings, so it is remembered (bounded).
        self._plans: dict[tuple[Any, ...], CallPlan | FallbackReason] = {}

    # -- the call --------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        reason = self._gate()
        if reason is None:
            plan = self._plan(args)
            if isinstance(plan, FallbackReason):
                reason = plan
            else:
                with self._lock:
                    if self._closed:
                        reason = FallbackReason.CLOSED
                    else:
                        out, reason = self._serve(args, plan)
                        if reason is None:
                            return out
                        if out is not None:  # re-verification answered this call eagerly
                            return self._fallback(args, reason, out)
        return self._fallback(args, reason)

    def _plan(self, args: tuple[Any, ...]) -> CallPlan | FallbackReason:
        """plan_call, remembered by the arguments' shapes, dtypes, devices and constants."""
        try:
            signature = call_signature(args)
            plan = self._plans.get(signature)
        except TypeError:  # an unhashable constant: plan_call names the reason
            return plan_call(args, self.buckets, self._device, self.stage_host_inputs)
        if plan is None:
            plan = plan_call(args, self.buckets, self._device, self.stage_host_inputs)
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[signature] = plan
        return plan

    def _serve(self, args: Sequence[Any], plan: CallPlan) -> tuple[Any, FallbackReason | None]:
        self.policy.record_call(plan.key)
        entry = self._cache.acquire(plan.key)
        if entry is not None:
            try:
                return self._replay(entry, args, plan)
            finally:
                self._cache.release(entry)
        reason = self._admission_reason(plan.key)
        if reason is not None:
            return None, reason
        return self._capture(args, plan, allow_evict=True)

    def _fallback(self, args: Sequence[Any], reason: FallbackReason, out: Any = None) -> Any:
        self._count_fallback(reason)
        return out if out is not None else self.fn(*args)

    # -- replay ----------------------------------------------------------------------------
    def _replay(
        self, entry: GraphEntry, args: Sequence[Any], plan: CallPlan
    ) -> tuple[Any, FallbackReason | None]:
        outputs = entry.replay(lambda: copy_inputs(entry, args, plan, self.buckets))
        every = self.verify.reverify_every
        if every and self.verify.enabled and entry.replays % every == 0:
            eager = self.fn(*entry.static_args)
            error = self._parity_error(entry.key, outputs, eager)
            if error is not None:
                self._cache.evict(entry.key, EvictionCause.REVERIFY)
                self._stats.parity_mismatches += 1
                self._quarantine(entry.key, f"drift on re-verification: {error}")
                return slice_outputs(eager, plan, copy=False), FallbackReason.PARITY_MISMATCH
        self._count_replay()
        return slice_outputs(outputs, plan, self.copy_outputs), None

    # -- capture ---------------------------------------------------------------------------
    def _capture(
        self, args: Sequence[Any], plan: CallPlan, allow_evict: bool
    ) -> tuple[Any, FallbackReason | None]:
        key = plan.key
        if allow_evict:
            # NOTE: the capture in flight reserves its expected bytes: eviction comes first, so
            # the device never holds more than the budget while the candidate captures.
            self._cache.make_room(self._expected_bytes(key))
        started = self.clock()
        entry = GraphEntry(key, self.backend)  # type: ignore[arg-type]
        try:
            outputs, reason = self._capture_verified(entry, args, plan)
        except BaseException:
            entry.retire()  # whatever escapes, the candidate's stream and pool go back
            raise
        if reason is not None:
            return None, reason
        self._count_capture(key, self.clock() - started, entry.resident_bytes)
        fits = self._cache.victims_for(entry.resident_bytes) == [] or allow_evict
        if not (fits and self._cache.admit(entry)):
            over = CaptureOutcome.OVER_BUDGET
            return None, self._reject(entry, over, FallbackReason.OVER_BUDGET, None)
        self._count_admitted(served=allow_evict)
        log.info(
            "graphguard capture key=%s bytes=%d ms=%.1f runner=%s",
            key.describe(),
            entry.resident_bytes,
            entry.capture_ms,
            self.name,
        )
        return slice_outputs(outputs, plan, self.copy_outputs), None

    def _capture_verified(
        self, entry: GraphEntry, args: Sequence[Any], plan: CallPlan
    ) -> tuple[Any, FallbackReason | None]:
        """Capture, replay once and compare with eager; a failure rejects the entry."""
        try:
            for owner in self._owners:
                entry.retain(owner)
            entry.capture(self.fn, make_static_args(entry, args, plan, self.buckets))
        except CaptureError as exc:
            failed = CaptureOutcome.FAILED
            return None, self._reject(entry, failed, FallbackReason.CAPTURE_FAILED, exc)
        outputs = entry.replay()
        if self.verify.enabled:
            error = self._parity_error(entry.key, outputs, self.fn(*entry.static_args))
            if error is not None:
                mismatch = FallbackReason.PARITY_MISMATCH
                outcome = CaptureOutcome.PARITY_MISMATCH
                return None, self._reject(entry, outcome, mismatch, error)
            entry.verified = self.verify.mode
        return outputs, None

    # -- set-up paths ----------------------------------------------------------------------
    def warmup(self, examples: Iterable[Sequence[Any]], progress: bool = True) -> WarmupReport:
        """Capture the keys of `examples` up front, largest first, within the budget."""
        report, started = WarmupReport(), time.perf_counter()
        plans = []
        for args in examples:
            plan = (
                plan_call(args, self.buckets, self.backend.device, self.stage_host_inputs)
                if self.backend is not None
                else FallbackReason.NO_CUDA
            )
            if isinstance(plan, FallbackReason):
                report.skipped[repr(args)[:80]] = plan.value
            else:
                plans.append((plan, args))
        plans.sort(key=lambda p: p[0].key.input_bytes, reverse=True)
        bar = tqdm(plans, desc=f"graphguard warmup {self.name}", disable=not progress)
        with self._lock:
            for plan, args in bar:
                self._warm_one(plan, args, report)
        report.seconds = time.perf_counter() - started
        log.info(
            "graphguard warmup runner=%s captured=%d skipped=%d seconds=%.2f",
            self.name,
            len(report.captured),
            len(report.skipped),
            report.seconds,
        )
        return report

    def _warm_one(self, plan: CallPlan, args: Sequence[Any], report: WarmupReport) -> None:
        name = plan.key.describe()
        if plan.key in self._cache:
            self.policy.prewarmed.add(plan.key)
            report.captured.append(name)
            return
        reason = self._gate() or self.policy.blocked_for_warmup(plan.key)
        if reason is None:
            _, reason = self._capture(args, plan, allow_evict=False)
        if reason is None:
            self.policy.prewarmed.add(plan.key)
            report.captured.append(name)
        else:
            report.skipped[name] = reason.value

    # -- lifecycle and introspection -------------------------------------------------------
    def entries(self) -> list[EntryInfo]:
        return [entry.info() for entry in self._cache.entries()]

    def admitted_keys(self) -> list[GraphKey]:
        return [entry.key for entry in self._cache.entries()]

    def stats(self) -> dict[str, Any]:
        """A snapshot: counts, bytes, fallbacks by reason, admission counters."""
        with self._lock:
            stats = self._base_stats()
            stats["entries"] = len(self._cache)
            return stats

    # -- manifests (graphguard.core.export) ------------------------------------------------
    def export(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Write a JSON manifest of the resident graphs to `path` and return it.

        Never resets or re-captures a graph; safe while replays run (graphguard.core.export).
        """
        from graphguard.core.export import export_manifest

        return export_manifest(self, path)

    def prewarm(self, manifest: Any, progress: bool = True) -> WarmupReport:
        """Capture exactly the keys of a manifest (a path or a loaded dict), largest first,
        within the budget. A manifest from another torch version or device is refused (see
        the report's `refused`) and the runner stays lazy; this never raises for a bad one."""
        from graphguard.core.prewarm import prewarm

        return prewarm(self, manifest, progress=progress)
