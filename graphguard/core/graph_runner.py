"""GraphRunner: the public callable over single graphs.

The flow of a call (replay, eager with one reason, or a capture earned) is the Runner's
(graphguard.core.runner); what is particular to single graphs is its kind, SingleGraphs
(graphguard.core.single_graphs); this file is the constructor and the public extras: plans,
warm-up from examples, entries, export and prewarm.

Manifests (export.py, prewarm.py) import no runner module: they read a runner only through its
public surface (`resident()`, `plan()`, `warmup()`, `max_bytes`, `buckets`), so the `export()`
and `prewarm()` conveniences here can call them without an import cycle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import Backend
from graphguard.core.capture import WarmupReport
from graphguard.core.entry import EntryInfo, GraphEntry
from graphguard.core.export import ManifestSource, export_manifest
from graphguard.core.inputs import (
    CallPlan,
)
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.prewarm import prewarm
from graphguard.core.reasons import FallbackReason
from graphguard.core.runner import Clock, Runner
from graphguard.core.single_graphs import Args, SingleGraphs
from graphguard.core.switch import resolve_backend
from graphguard.core.verify import (
    VerifyConfig,
)

log = logging.getLogger("graphguard")


class GraphRunner(Runner[GraphEntry, Args]):
    """Replays CUDA graphs of `fn` under a byte budget, verified against eager.

    Args:
        fn: callable on tensors (and hashable constants) returning a tensor, tuple, list or dict
            of tensors. It must not depend on host-side state that changes between calls.
        buckets: pad dimension 0 of every tensor argument up to a bucket and slice outputs back;
            without it, graphs are keyed by exact shapes, dtypes and devices.
        max_bytes: resident byte budget for all graphs of this runner.
        verify: "exact" (bitwise), "off", or a VerifyConfig ("allclose" with rtol and atol, and
            `reverify_every`: compare every N-th replay with eager too).
        admission: when a key earns a capture (AdmissionConfig).
        capture: how graphs are captured and served (CaptureConfig: background capture,
            example inputs, retained owners, device, output copies, host staging, padding to a
            larger bucket, strictness).
        backend: "auto" (CUDA when present, else eager with no_cuda), "cuda", "sim" or a Backend.
        metrics: a GraphMetrics to report into (shared across runners), or a private one.
        clock: time source of every admission decision (tests inject a fake one).
        name: the runner's name in logs, metrics and stats.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        buckets: Buckets | None = None,
        max_bytes: int = 1 << 30,
        verify: str | VerifyConfig = "exact",
        admission: AdmissionConfig | None = None,
        capture: CaptureConfig | None = None,
        backend: str | Backend = "auto",
        metrics: GraphMetrics | None = None,
        clock: Clock = time.monotonic,
        name: str = "graph",
    ):
        capture = capture or CaptureConfig()
        if capture.background and buckets is None and capture.examples is None:
            raise ValueError(
                "background capture runs on example inputs: give buckets (all-padding rows) or "
                "examples(key)"
            )
        verify = verify if isinstance(verify, VerifyConfig) else VerifyConfig(verify)
        resolved = resolve_backend(backend, capture.device)
        kind = SingleGraphs(fn, buckets, resolved, verify, capture, name)
        super().__init__(
            kind, backend=resolved, max_bytes=max_bytes, admission=admission, capture=kind.options,
            metrics=metrics, clock=clock, name=name,
        )  # fmt: skip
        self.kind: SingleGraphs = kind
        self.buckets = buckets

    def __call__(self, *args: Any) -> Any:
        return self.run(args)

    def plan(self, args: Sequence[Any]) -> CallPlan | FallbackReason:
        """The key a call with `args` maps to (and its real rows), or why it runs eagerly."""
        if self.backend is None:
            return FallbackReason.NO_CUDA
        return self.kind.plan(tuple(args))

    def warmup(self, examples: Iterable[Sequence[Any]], progress: bool = True) -> WarmupReport:
        """Capture the keys of `examples` up front, largest first, within the budget."""
        started, plans, skipped = time.perf_counter(), [], {}
        for args in examples:
            plan = self.plan(args)
            if isinstance(plan, FallbackReason):
                skipped[repr(args)[:80]] = plan.value
            else:
                plans.append((plan, tuple(args)))
        report = self._warm(plans, started, progress)
        report.skipped.update(skipped)
        return report

    def entries(self) -> list[EntryInfo]:
        return [entry.info() for entry in self._cache.entries()]

    def admitted_keys(self) -> list[GraphKey]:
        return [entry.key for entry in self._cache.entries()]

    def stats(self) -> dict[str, Any]:
        """A snapshot: counts, bytes, fallbacks by reason, admission counters."""
        stats = super().stats()
        stats["entries"] = len(self._cache)
        return stats

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
