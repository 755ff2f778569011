"""Prewarm a runner from a manifest written by export.py.

Prewarm captures exactly the manifest's keys, largest first, inside the byte budget. A manifest
from another torch, device or model (or one that cannot be read) is refused with a reason, and
the runner stays lazy: refusing never raises.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphguard.core.export import (
    ManifestError,
    ManifestSource,
    ManifestVersionError,
    environment,
    key_from_json,
    read_manifest,
)
from graphguard.core.inputs import plan_call
from graphguard.core.keys import TensorSpec
from graphguard.core.runner import WarmupReport

if TYPE_CHECKING:
    from graphguard.core.runner import GraphRunner

log = logging.getLogger("graphguard")


@dataclass
class PrewarmReport(WarmupReport):
    """A WarmupReport plus why the manifest was refused (None when it was used)."""

    refused: str | None = None
    manifest: str | None = None


def refusal(
    manifest: dict[str, Any], env: dict[str, Any], model: dict[str, Any] | None
) -> tuple[str, str] | None:
    """(reason, message) when `manifest` must not prewarm here; None when it may."""
    theirs = manifest["environment"]
    if theirs.get("torch") != env["torch"]:
        return "torch", f"manifest is from torch {theirs.get('torch')}; this is {env['torch']}"
    there = (theirs.get("device"), theirs.get("backend"))
    here = (env["device"], env["backend"])
    if there != here:
        return "device", f"manifest is for {_where(*there)}; this runner is on {_where(*here)}"
    if model is not None and not _same_model(manifest.get("model"), model):
        return "model", f"manifest is for {_model(manifest.get('model'))}; this is {_model(model)}"
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
    runner: GraphRunner,
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
    try:
        data = read_manifest(manifest)
        refused = refusal(data, environment(runner.backend), model)
    except ManifestVersionError as exc:
        refused = ("version", str(exc))
    except ManifestError as exc:
        refused = ("unreadable", str(exc))
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
    runner: GraphRunner, graphs: list[dict[str, Any]]
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
            skipped[name] = f"unreadable_key: {exc}"
            continue
        problem = _unbuildable(runner, key)
        if problem is not None:
            skipped[name] = problem  # checked before anything is allocated for it
            continue
        args = tuple(_example_arg(runner, i, a) for i, a in enumerate(key.args))
        if device is not None:
            plan = plan_call(args, runner.buckets, device, runner.stage_host_inputs)
            if getattr(plan, "key", None) != key:
                skipped[name] = f"key_mismatch: this runner maps it to {_describe(plan)}"
                continue
        examples.append(args)
    return examples, skipped


def _unbuildable(runner: GraphRunner, key: Any) -> str | None:
    """Why a manifest key's example inputs must not be allocated, if they must not."""
    if any(size < 0 for spec in key.tensor_specs for size in spec.shape):
        return "unreadable_key: negative dimension"
    if key.input_bytes > runner._cache.max_bytes:
        return "over_budget: its inputs alone exceed the byte budget"
    return None


def _example_arg(runner: GraphRunner, position: int, arg: Any) -> Any:
    if not isinstance(arg, TensorSpec):
        return arg
    pad: float | int = 0
    if runner.buckets is not None:
        try:
            pad = runner.buckets.pad_for(position)
        except ValueError:
            pad = 0
    return torch.full(arg.shape, pad, dtype=arg.dtype, device=arg.device)


def _describe(plan: Any) -> str:
    key = getattr(plan, "key", None)
    return key.describe() if key is not None else str(getattr(plan, "value", plan))


def _refuse(
    runner: GraphRunner, source: str, refused: tuple[str, str], started: float
) -> PrewarmReport:
    reason, message = refused
    report = PrewarmReport(
        seconds=time.perf_counter() - started, refused=f"{reason}: {message}", manifest=source
    )
    runner.metrics.prewarm_refusals.labels(reason).inc()
    log.warning(
        "graphguard prewarm refused runner=%s manifest=%s reason=%s; graphs will be captured "
        "lazily",
        runner.name,
        source,
        report.refused,
    )
    return report


def _record(runner: GraphRunner, report: PrewarmReport) -> None:
    metrics = runner.metrics
    metrics.prewarm_seconds.set(report.seconds)
    metrics.prewarm_keys.labels("prewarmed").inc(len(report.captured))
    metrics.prewarm_keys.labels("skipped").inc(len(report.skipped))
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
