"""Prewarm a runner from a manifest written by export.py.

Prewarm captures exactly the manifest's keys, largest first, inside the byte budget. A manifest
from another torch, device or model (or one that cannot be read) is refused with a reason, and
the runner stays lazy: refusing never raises. Like export, this module imports no runner
module and reads a runner only through its public surface (Prewarmable): `plan()` to check
that a key maps to itself here, `warmup()` to capture.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from graphguard.core.capture import WarmupReport
from graphguard.core.export import (
    Exportable,
    ManifestError,
    ManifestSource,
    ManifestVersionError,
    environment,
    key_from_json,
    read_manifest,
)
from graphguard.core.inputs import CallPlan, padding_example
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import FallbackReason, PrewarmOutcome, PrewarmRefusal, PrewarmSkip

log = logging.getLogger("graphguard")


class Prewarmable(Exportable, Protocol):
    """What prewarm uses of a runner (GraphRunner has it): what export reads, and planning,
    warm-up and metrics; its public surface only."""

    @property
    def metrics(self) -> GraphMetrics: ...
    def plan(self, args: Sequence[Any]) -> CallPlan | FallbackReason: ...
    def warmup(self, examples: Iterable[Sequence[Any]], progress: bool = True) -> WarmupReport: ...


@dataclass
class PrewarmReport(WarmupReport):
    """A WarmupReport plus why the manifest was refused (None when it was used)."""

    refused: str | None = None
    manifest: str | None = None


Refusal = tuple[PrewarmRefusal, str]  # the reason, and a message that says what differs


def refusal(
    manifest: dict[str, Any], env: dict[str, Any], model: dict[str, Any] | None
) -> Refusal | None:
    """(reason, message) when `manifest` must not prewarm here; None when it may."""
    theirs = manifest["environment"]
    if theirs.get("torch") != env["torch"]:
        message = f"manifest is from torch {theirs.get('torch')}; this is {env['torch']}"
        return PrewarmRefusal.TORCH, message
    there = (theirs.get("device"), theirs.get("backend"))
    here = (env["device"], env["backend"])
    if there != here:
        message = f"manifest is for {_where(*there)}; this runner is on {_where(*here)}"
        return PrewarmRefusal.DEVICE, message
    if model is not None and not _same_model(manifest.get("model"), model):
        message = f"manifest is for {_model(manifest.get('model'))}; this is {_model(model)}"
        return PrewarmRefusal.MODEL, message
    return None


def _same_model(theirs: Any, ours: dict[str, Any]) -> bool:
    return isinstance(theirs, dict) and all(theirs.get(k) == v for k, v in ours.items())


def _where(device: Any, backend: Any) -> str:
    return f"{device} ({backend} backend)" if backend else "no graph backend (no CUDA)"


def _model(model: Any) -> str:
    if not isinstance(model, dict):
        return "no model"
    return f"model {model.get('name')} (config {model.get('config_hash')})"


# -- prewarm -------------------------------------------------------------------------------
def prewarm(
    runner: Prewarmable,
    manifest: ManifestSource,
    *,
    progress: bool = True,
    model: dict[str, Any] | None = None,
) -> PrewarmReport:
    """Capture exactly the manifest's keys, largest first, inside the runner's budget.

    A manifest that cannot be read, or that comes from another torch, device or model (when
    `model` is given), is refused: nothing is captured, the reason is in the report, a metric
    and a warning say so, and the runner keeps capturing lazily. This never raises for a bad
    manifest.
    """
    started = time.perf_counter()
    source = "<dict>" if isinstance(manifest, dict) else os.fspath(manifest)
    refused: Refusal | None
    try:
        data = read_manifest(manifest)
        refused = refusal(data, environment(runner.backend), model)
    except ManifestVersionError as exc:
        refused = PrewarmRefusal.VERSION, str(exc)
    except ManifestError as exc:
        refused = PrewarmRefusal.UNREADABLE, str(exc)
    if refused is not None:
        return _refuse(runner, source, refused, started)
    examples, skipped = plan_examples(runner, data["graphs"])
    warm = runner.warmup(examples, progress=progress)
    report = PrewarmReport(
        captured=warm.captured,
        skipped={**skipped, **warm.skipped},
        seconds=time.perf_counter() - started,
        manifest=source,
    )
    _record(runner, report)
    return report


def plan_examples(
    runner: Prewarmable, graphs: list[dict[str, Any]]
) -> tuple[list[tuple[Any, ...]], dict[str, str]]:
    """Example arguments for each manifest key that maps to the same key in `runner`.

    Tensors are filled with the runner's pad value of their position (all-padding batches,
    which the engine points at its dummy KV block), or zeros without buckets.
    """
    device = runner.backend.device if runner.backend is not None else None
    examples: list[tuple[Any, ...]] = []
    skipped: dict[str, str] = {}
    for record in graphs:
        name = str(record.get("key_text", record["key"]))
        try:
            key = key_from_json(record["key"], device)
        except ManifestError as exc:
            skipped[name] = f"{PrewarmSkip.UNREADABLE_KEY.value}: {exc}"
            continue
        problem = _unbuildable(runner, key)
        if problem is not None:
            skipped[name] = problem  # checked before anything is allocated for it
            continue
        args = padding_example(key, runner.buckets)
        if device is not None:
            plan = runner.plan(args)
            if isinstance(plan, FallbackReason) or plan.key != key:
                mapped = plan.value if isinstance(plan, FallbackReason) else plan.key.describe()
                skipped[name] = f"{PrewarmSkip.KEY_MISMATCH.value}: this runner maps it to {mapped}"
                continue
        examples.append(args)
    return examples, skipped


def _unbuildable(runner: Prewarmable, key: GraphKey) -> str | None:
    """Why a manifest key's example inputs must not be allocated, if they must not."""
    if any(size < 0 for spec in key.tensor_specs for size in spec.shape):
        return f"{PrewarmSkip.UNREADABLE_KEY.value}: negative dimension"
    if key.input_bytes > runner.max_bytes:
        return f"{PrewarmSkip.OVER_BUDGET.value}: its inputs alone exceed the byte budget"
    return None


def _refuse(runner: Prewarmable, source: str, refused: Refusal, started: float) -> PrewarmReport:
    reason, message = refused
    report = PrewarmReport(
        seconds=time.perf_counter() - started,
        refused=f"{reason.value}: {message}",
        manifest=source,
    )
    runner.metrics.prewarm_refusals.labels(reason.value).inc()
    log.warning(
        "graphguard prewarm refused runner=%s manifest=%s reason=%s; graphs will be captured "
        "lazily",
        runner.name,
        source,
        report.refused,
    )
    return report


def _record(runner: Prewarmable, report: PrewarmReport) -> None:
    metrics = runner.metrics
    metrics.prewarm_seconds.set(report.seconds)
    metrics.prewarm_keys.labels(PrewarmOutcome.PREWARMED.value).inc(len(report.captured))
    metrics.prewarm_keys.labels(PrewarmOutcome.SKIPPED.value).inc(len(report.skipped))
    log.info(
        "graphguard prewarm runner=%s manifest=%s prewarmed=%d skipped=%d seconds=%.2f",
        runner.name,
        report.manifest,
        len(report.captured),
        len(report.skipped),
        report.seconds,
    )
    for key, why in report.skipped.items():
        log.info("graphguard prewarm skipped key=%s why=%s", key, why)
