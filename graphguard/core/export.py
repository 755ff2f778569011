"""Graph manifests: export what a runner captured (prewarm.py reads them back).

A manifest is versioned JSON: the environment it was captured in, the model it belongs to (the
engine fills that in), and for each resident graph its key (machine-readable), state, bytes,
capture time, parity result, replay count, static input and output specs and node inventory.

Export never resets or re-captures a graph. It reads a runner only through its public surface
(Exportable) and imports no runner module: `runner.resident()` pins every admitted entry
(eviction skips pinned entries), and each one is read under the entry's own lock, which
retire() takes too, so an entry invalidated meanwhile is retired only after export has finished
reading it. Replays of other entries go on while export runs.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from graphguard.core.backends import Backend
from graphguard.core.entry import GraphEntry
from graphguard.core.inventory import NodeInventory, load_bindings, read_inventory, unavailable
from graphguard.core.keys import Buckets, GraphKey, TensorSpec
from graphguard.version import __version__

log = logging.getLogger("graphguard")

MANIFEST_FORMAT = "graphguard-manifest"
MANIFEST_VERSION = 1
InventoryReader = Callable[[Any, "str | None"], NodeInventory]
ManifestSource = str | os.PathLike[str] | dict[str, Any]


class ManifestError(ValueError):
    """A manifest that is not valid JSON of this format, or a key that cannot be rebuilt."""


class ManifestVersionError(ManifestError):
    """A manifest of this format written in another version of it."""


class Exportable(Protocol):
    """What export reads of a runner (GraphRunner has it): its public surface only."""

    @property
    def name(self) -> str: ...
    @property
    def backend(self) -> Backend | None: ...
    @property
    def buckets(self) -> Buckets | None: ...
    @property
    def max_bytes(self) -> int: ...
    def resident(self) -> AbstractContextManager[list[GraphEntry]]: ...


# -- environment and identity --------------------------------------------------------------
def environment(backend: Any) -> dict[str, Any]:
    """Where graphs were (or would be) captured: torch, CUDA, driver, device, graphguard."""
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver_version(),
        "backend": getattr(backend, "name", None),
        "device": device_name(backend),
        "graphguard": __version__,
        "python": platform.python_version(),
    }


def device_name(backend: Any) -> str | None:
    if backend is None:
        return None
    device = backend.device
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return str(device.type)


def driver_version() -> str | None:
    """The CUDA driver's version ("13.0"), when cuda.bindings can ask for it."""
    bindings = load_bindings()
    if isinstance(bindings, str):
        return None
    try:
        err, version = bindings[0].cudaDriverGetVersion()
    except Exception:  # noqa: BLE001 - an unknown driver is recorded as unknown
        return None
    if err != bindings[0].cudaError_t.cudaSuccess or not version:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def model_identity(name: str, config: Any, **extra: Any) -> dict[str, Any]:
    """{"name", "config_hash", ...extra}: what a manifest must match to prewarm a model."""
    payload = asdict(config) if is_dataclass(config) and not isinstance(config, type) else config
    text = json.dumps({"config": payload, **extra}, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return {"name": name, "config_hash": digest, **{k: str(v) for k, v in extra.items()}}


# -- keys ----------------------------------------------------------------------------------
def key_to_json(key: GraphKey) -> dict[str, Any]:
    """A GraphKey as JSON: tensor args as shape/dtype/device, other args as constants."""
    args = [
        {"tensor": _spec_json(a)} if isinstance(a, TensorSpec) else {"const": _const_json(a)}
        for a in key.args
    ]
    return {"rows": key.rows, "args": args}


def key_from_json(data: dict[str, Any], device: torch.device | None = None) -> GraphKey:
    """Rebuild a key; tensors on `device`'s type are moved to `device` (another index)."""
    try:
        args = tuple(_arg_from_json(a, device) for a in data["args"])
        rows = data["rows"]
        return GraphKey(args, None if rows is None else int(rows))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ManifestError(f"unreadable key {data!r}: {exc}") from exc


def _spec_json(spec: TensorSpec) -> dict[str, Any]:
    return {"shape": list(spec.shape), "dtype": _dtype_name(spec.dtype), "device": str(spec.device)}


def _const_json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_const_json(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    return {"repr": repr(value)}  # recorded for reading; such a key cannot be prewarmed


def _arg_from_json(arg: dict[str, Any], device: torch.device | None) -> Any:
    if "tensor" not in arg:
        return _const_from_json(arg["const"])
    spec = arg["tensor"]
    where = torch.device(spec["device"])
    if device is not None and where.type == device.type:
        where = device
    return TensorSpec(tuple(int(s) for s in spec["shape"]), _dtype(spec["dtype"]), where)


def _const_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(_const_from_json(v) for v in value["tuple"])
        if "dtype" in value:
            return _dtype(value["dtype"])
        raise ManifestError(f"constant {value.get('repr', value)} cannot be rebuilt")
    if isinstance(value, list):
        raise ManifestError(f"constant {value!r} is not hashable")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r}")
    return dtype


# -- export --------------------------------------------------------------------------------
def export_manifest(
    runner: Exportable,
    path: str | os.PathLike[str],
    *,
    model: dict[str, Any] | None = None,
    read: InventoryReader = read_inventory,
) -> dict[str, Any]:
    """Write the manifest of `runner`'s resident graphs to `path` (atomically); return it."""
    backend = runner.backend.name if runner.backend is not None else None
    with runner.resident() as entries:
        graphs = [_graph_record(entry, backend, read) for entry in entries]
    # largest first; graphs of one pool segment each are told apart by their padded rows
    graphs.sort(key=lambda g: (g["resident_bytes"], g.get("rows") or 0), reverse=True)
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": environment(runner.backend),
        "model": model,
        "runner": _runner_record(runner, graphs),
        "graphs": graphs,
    }
    _write_atomically(Path(path), json.dumps(manifest, indent=1))
    log.info("graphguard export runner=%s graphs=%d path=%s", runner.name, len(graphs), path)
    return manifest


def _graph_record(entry: GraphEntry, backend: str | None, read: InventoryReader) -> dict:
    # NOTE: the entry's lock keeps retire() (and so graph.reset()) out while the graph is read.
    with entry.lock:
        info = entry.info()
        inventory = unavailable("retired") if entry.is_retired else read(entry.graph, backend)
    return {
        "key": key_to_json(entry.key),
        "key_text": info.key,
        "state": info.state,
        "rows": info.rows,
        "resident_bytes": info.resident_bytes,
        "host_bytes": info.host_bytes,
        "capture_ms": info.capture_ms,
        "parity": info.verified,
        "eager_spread": info.eager_spread,
        "graph_error": info.graph_error,
        "replays": info.replays,
        "inputs": info.input_specs,
        "outputs": info.output_specs,
        "inventory": inventory.to_json(),
    }


def _runner_record(runner: Exportable, graphs: list[dict[str, Any]]) -> dict[str, Any]:
    buckets = runner.buckets
    return {
        "name": runner.name,
        "max_bytes": runner.max_bytes,
        "resident_bytes": sum(g["resident_bytes"] for g in graphs),
        "buckets": list(buckets.batch) if buckets is not None else None,
    }


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


# -- reading and validation ----------------------------------------------------------------
def read_manifest(source: ManifestSource) -> dict[str, Any]:
    """Load and validate a manifest (a path or an already loaded dict); ManifestError if bad."""
    if isinstance(source, dict):
        data = source
    else:
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ManifestError(f"cannot read {os.fspath(source)}: {exc}") from exc
    validate_manifest(data)
    return data


def validate_manifest(data: Any) -> None:
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"not a graphguard manifest (format is not {MANIFEST_FORMAT!r})")
    if data.get("version") != MANIFEST_VERSION:
        raise ManifestVersionError(
            f"manifest version {data.get('version')!r}; this graphguard reads {MANIFEST_VERSION}"
        )
    graphs = data.get("graphs")
    if not isinstance(data.get("environment"), dict) or not isinstance(graphs, list):
        raise ManifestError("manifest lacks its environment or its list of graphs")
    if not all(isinstance(g, dict) and isinstance(g.get("key"), dict) for g in graphs):
        raise ManifestError("every graph of a manifest needs a key")
