"""`graphguard inspect MANIFEST [--json]`: what a runner had captured, as a readable table.

One row per graph (largest first): state, rows, resident bytes, capture milliseconds, parity
result, replays, node and kernel counts and the key; then the most launched kernels of each
graph, or why its node inventory could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from graphguard.core.export import ManifestError, read_manifest

MAX_KERNEL_NAME = 96
COLUMNS = ("#", "state", "rows", "resident", "capture ms", "parity", "replays", "nodes", "kernels")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphguard inspect",
        description="Print a graph manifest written by GraphRunner.export() or the engine.",
    )
    parser.add_argument("manifest", metavar="MANIFEST", help="path of the manifest (JSON)")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.add_argument(
        "--kernels",
        type=int,
        default=5,
        metavar="N",
        help="most launched kernels to list per graph; 0 lists none (default: 5)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `graphguard inspect`; 0 on success, 1 for an unreadable manifest."""
    args = build_parser().parse_args(argv)
    try:
        manifest = read_manifest(args.manifest)
    except ManifestError as exc:
        print(f"graphguard inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print(render(manifest, max_kernels=args.kernels))
    return 0


def render(manifest: dict[str, Any], max_kernels: int = 5) -> str:
    """The manifest as text: a header, a table of graphs, then kernels per graph."""
    graphs = manifest["graphs"]
    lines = header(manifest)
    lines += ["", *table([_row(i, g) for i, g in enumerate(graphs)], graphs)]
    for index, graph in enumerate(graphs):
        lines += kernel_lines(index, graph.get("inventory", {}), max_kernels)
    return "\n".join(lines)


def header(manifest: dict[str, Any]) -> list[str]:
    env, runner = manifest["environment"], manifest.get("runner", {})
    model = manifest.get("model")
    graphs = manifest["graphs"]
    resident = sum(int(g.get("resident_bytes", 0)) for g in graphs)
    lines = [
        f"graphguard manifest v{manifest['version']}, written {manifest.get('created', '?')} "
        f"by graphguard {env.get('graphguard', '?')}",
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, driver {env.get('driver')}, "
        f"device {env.get('device')} ({env.get('backend')} backend)",
    ]
    if isinstance(model, dict):
        extra = ", ".join(f"{k} {v}" for k, v in model.items() if k not in ("name", "config_hash"))
        lines.append(f"model {model.get('name')} (config {model.get('config_hash')}) {extra}")
    budget = runner.get("max_bytes")
    lines.append(
        f"runner {runner.get('name', '?')}: {len(graphs)} graphs, {human_bytes(resident)} "
        f"resident of {human_bytes(budget) if budget is not None else '?'}"
    )
    return lines


def _row(index: int, graph: dict[str, Any]) -> list[str]:
    inventory = graph.get("inventory", {})
    available = inventory.get("available", False)
    return [
        str(index),
        str(graph.get("state", "?")),
        str(graph.get("rows", "-")),
        human_bytes(graph.get("resident_bytes")),
        f"{float(graph.get('capture_ms', 0.0)):.1f}",
        str(graph.get("parity", "?")),
        str(graph.get("replays", "?")),
        str(inventory.get("num_nodes")) if available else "-",
        str(sum(inventory.get("kernels", {}).values())) if available else "-",
    ]


def table(rows: list[list[str]], graphs: list[dict[str, Any]]) -> list[str]:
    """Right-aligned columns, with each graph's key after them (keys are long)."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(COLUMNS)]

    def line(cells: list[str] | tuple[str, ...], key: str) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + "  " + key

    out = [line(COLUMNS, "key")]
    out += [line(r, str(g.get("key_text", "?"))) for r, g in zip(rows, graphs, strict=True)]
    return out


def kernel_lines(index: int, inventory: dict[str, Any], max_kernels: int) -> list[str]:
    if not inventory.get("available"):
        return [f"graph {index}: {inventory.get('reason', 'unavailable')}"]
    if max_kernels <= 0:
        return []
    types = ", ".join(f"{n} {t}" for t, n in inventory.get("node_types", {}).items())
    lines = [f"graph {index}: {inventory.get('num_nodes')} nodes ({types})"]
    kernels = sorted(inventory.get("kernels", {}).items(), key=lambda kv: -kv[1])
    for name, count in kernels[:max_kernels]:
        lines.append(f"  {count:>5} x {shorten(name)}")
    if len(kernels) > max_kernels:
        lines.append(f"  ... {len(kernels) - max_kernels} more kernels (--kernels N, --json)")
    return lines


def shorten(name: str, limit: int = MAX_KERNEL_NAME) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


def human_bytes(num_bytes: Any) -> str:
    if num_bytes is None:
        return "?"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
