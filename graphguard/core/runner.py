"""GraphRunner: the public callable.

Every call either replays an admitted graph or runs eagerly with exactly one FallbackReason
(the flow is RunnerBase's; this module keys single graphs by the call's padded arguments).
Replays of one runner are serialized by the runner's lock (lock order: engine lifecycle lock,
then this runner's lock, then its cache's lock).

Manifests (export.py, prewarm.py) import no runner module: they read a runner only through its
public surface (`resident()`, `plan()`, `warmup()`, `max_bytes`), so the `export()` and
`prewarm()` conveniences here can call them without an import cycle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from graphguard.core.admission import AdmissionConfig, Clock
from graphguard.core.backends import Backend, CaptureError
from graphguard.core.background import CaptureUnits
from graphguard.core.base import RunnerBase, WarmupReport
from graphguard.core.capture_flow import CaptureMode, Verified
from graphguard.core.decisions import Agreement, Orders
from graphguard.core.entry import EntryInfo, GraphEntry
from graphguard.core.export import ManifestSource, export_manifest
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
from graphguard.core.metrics import GraphMetrics, RunnerStats
from graphguard.core.prewarm import prewarm
from graphguard.core.reasons import CaptureOutcome, EvictionCause, FallbackReason
from graphguard.core.switch import KILL_SWITCH_ENV, kill_switch_on, resolve_backend
from graphguard.core.verify import ParityError, VerifyConfig, parity_error

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

Args = tuple[Any, ...]  # one call's arguments


class GraphRunner(RunnerBase[GraphEntry, Args]):
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
        background: capture between calls instead of in the call that earns a key: that call
            and the key's next ones run eagerly (capture_in_progress) while whoever drives the
            runner calls advance_capture() between calls, one bounded unit of work each time.
        examples: inputs of a key for a capture between calls (`examples(key)` -> arguments);
            default: every row padding (needs buckets).
        max_pad_factor: a call whose bucket has no graph yet (its capture not earned or in
            flight) replays the smallest admitted larger bucket of the same call, up to this
            many times its bucket's rows, instead of answering eagerly: its real rows are
            copied in and the rest padded, as for its own bucket. 1 (default): never. The
            call counts as a replay (`covered` in stats); the key goes on earning its own
            graph by the admission rules, but payback counts no eager time for it meanwhile.
        agreement, orders: a tensor-parallel rank's (graphguard.core.decisions); None: one
            process that decides and agrees with itself.
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
        background: bool = False,
        examples: Callable[[GraphKey], Sequence[Any]] | None = None,
        max_pad_factor: int = 1,
        agreement: Agreement | None = None,
        orders: Orders | None = None,
    ):
        if max_pad_factor < 1:
            raise ValueError(f"max_pad_factor must be >= 1, got {max_pad_factor}")
        if background and buckets is None and examples is None:
            raise ValueError(
                "background capture runs on example inputs: give buckets (all-padding rows) or "
                "examples(key)"
            )
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
            background=background,
            agreement=agreement,
            orders=orders,
        )
        self.fn = fn
        self.examples = examples
        self.buckets = buckets
        self.max_pad_factor = max_pad_factor
        self.stage_host_inputs = stage_host_inputs
        # NOTE: planning a call is the largest host cost of a replay; a plan depends only on
        # the call's signature and the runner's fixed settings, so it is remembered (bounded).
        self._plans: dict[tuple[Any, ...], CallPlan | FallbackReason] = {}

    # -- the call (RunnerBase._run is the flow; the hooks follow) ---------------------------
    def __call__(self, *args: Any) -> Any:
        return self._run(args)

    def plan(self, args: Sequence[Any]) -> CallPlan | FallbackReason:
        """The key a call with `args` maps to (and its real rows), or why it runs eagerly."""
        if self.backend is None:
            return FallbackReason.NO_CUDA
        return self._plan(tuple(args))

    def _plan(self, args: Args) -> CallPlan | FallbackReason:
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

    def _eager(self, args: Args) -> Any:
        return self.fn(*args)

    def _cover(self, key: GraphKey) -> GraphKey | None:
        """The smallest admitted larger bucket of `key` within max_pad_factor (under the
        lock)."""
        rows = key.rows
        if self.max_pad_factor == 1 or self.buckets is None or rows is None:
            return None
        for size in self.buckets.batch:
            if size > rows * self.max_pad_factor:
                break
            if size > rows and (bigger := key.with_rows(size)) in self._cache:
                return bigger
        return None

    def _example(self, key: GraphKey) -> tuple[Args, CallPlan]:
        if self.examples is not None:
            args = tuple(self.examples(key))
        else:
            args = padding_example(key, self.buckets)
        plan = self._plan(args)
        if isinstance(plan, FallbackReason) or plan.key != key:
            raise ValueError(f"example inputs of {key.describe()} do not map to that key")
        return args, CallPlan(key, key.rows)  # every row counts: nothing is sliced off

    def _replay(
        self, entry: GraphEntry, args: Args, plan: CallPlan
    ) -> tuple[Any, FallbackReason | None]:
        outputs = entry.replay(lambda: copy_inputs(entry, args, plan, self.buckets))
        every = self.verify.reverify_every
        if every and self.verify.enabled and entry.replays % every == 0:
            eager = self.fn(*entry.static_args)
            error = parity_error(entry.key, outputs, eager, self.verify)
            if error is not None:
                self._cache.evict(entry.key, EvictionCause.REVERIFY)
                self._counts.drift()
                self._quarantine(entry.key, f"drift on re-verification: {error}")
                return slice_outputs(eager, plan, copy=False), FallbackReason.PARITY_MISMATCH
        self._counts.replay()
        return slice_outputs(outputs, plan, self.copy_outputs), None

    def _new_candidate(self, key: GraphKey) -> GraphEntry:
        assert self.backend is not None
        return GraphEntry(key, self.backend)

    def _capture_verified(
        self, entry: GraphEntry, args: Args, plan: CallPlan
    ) -> CaptureUnits[Verified]:
        """Capture, replay once and compare with eager; a failure rejects the entry. Units:
        static inputs and the first warm-up, each further warm-up, the capture, the check."""
        try:
            for owner in self._owners:
                entry.retain(owner)
            static_args = make_static_args(entry, args, plan, self.buckets)
            for _ in range(entry.backend.num_warmup):
                entry.warm_up(self.fn)
                yield
            entry.capture(self.fn, static_args)
        except CaptureError as exc:
            return None, None, self._reject(entry, CaptureOutcome.FAILED, exc)
        yield
        outputs = entry.replay()
        if self.verify.enabled:
            # NOTE: eager runs on the padded static inputs, so it does not answer the call.
            eager = self.fn(*entry.static_args)
            error = parity_error(entry.key, outputs, eager, self.verify)
            if error is not None:
                return None, None, self._reject(entry, CaptureOutcome.PARITY_MISMATCH, error)
        entry.verified = self.verify.mode  # the check it passed: "off" when none ran
        return outputs, None, None

    def _admitted(self, entry: GraphEntry, outputs: Any, plan: CallPlan, mode: CaptureMode) -> Any:
        log.info(
            "graphguard capture key=%s bytes=%d ms=%.1f runner=%s",
            entry.key.describe(),
            entry.resident_bytes,
            entry.capture_ms,
            self.name,
        )
        if mode is not CaptureMode.ON_CALL:
            return None
        return slice_outputs(outputs, plan, self.copy_outputs)

    # -- set-up paths ----------------------------------------------------------------------
    def warmup(self, examples: Iterable[Sequence[Any]], progress: bool = True) -> WarmupReport:
        """Capture the keys of `examples` up front, largest first, within the budget."""
        report, started = WarmupReport(), time.perf_counter()
        plans = []
        for args in examples:
            plan = self.plan(args)
            if isinstance(plan, FallbackReason):
                report.skipped[repr(args)[:80]] = plan.value
            else:
                plans.append((plan, tuple(args)))
        return self._warm_plans(plans, report, started, progress)

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

    # -- manifests (graphguard.core.export, graphguard.core.prewarm) -----------------------
    def export(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Write a JSON manifest of the resident graphs to `path` and return it.

        Never resets or re-captures a graph; safe while replays run (export_manifest).
        """
        return export_manifest(self, path)

    def prewarm(self, manifest: ManifestSource, progress: bool = True) -> WarmupReport:
        """Capture exactly the keys of a manifest (a path or a loaded dict), largest first,
        within the budget. A manifest from another torch version or device is refused (see
        the report's `refused`) and the runner stays lazy; this never raises for a bad one."""
        return prewarm(self, manifest, progress=progress)
