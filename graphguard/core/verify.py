"""Parity of a graph's output against eager on the same inputs.

A new graph's first replay is compared with eager before it is admitted; `reverify_every=N`
repeats the comparison on every N-th replay in production and quarantines on drift. "exact" is
bitwise equality (NaN equals NaN of the same bits); "allclose" takes explicit tolerances;
"spread" is for steps whose eager run is not reproducible (some third-party kernels): eager runs
twice from the same state, and the graph is admitted only within eager's own run-to-run spread
(`spread_error`); "off" must be asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from graphguard.core.keys import GraphKey

_MODES = ("exact", "allclose", "spread", "off")


class ParityError(RuntimeError):
    """Raised in strict mode when a graph's output differs from eager."""


@dataclass(frozen=True)
class VerifyConfig:
    mode: str = "exact"
    rtol: float | None = None
    atol: float | None = None
    reverify_every: int = 0  # 0: only at admission

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"verify must be one of {_MODES}, got {self.mode!r}")
        if self.mode == "allclose" and (self.rtol is None or self.atol is None):
            raise ValueError("verify='allclose' needs explicit rtol and atol")
        if self.reverify_every < 0:
            raise ValueError(f"reverify_every must be >= 0, got {self.reverify_every}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def outputs_match(graph_out: Any, eager_out: Any, config: VerifyConfig) -> bool:
    """True if every tensor leaf of the two outputs agrees under `config`."""
    graph_leaves, graph_spec = tree_flatten(graph_out)
    eager_leaves, eager_spec = tree_flatten(eager_out)
    if graph_spec != eager_spec:
        return False
    return all(_leaf_match(g, e, config) for g, e in zip(graph_leaves, eager_leaves, strict=True))


def parity_error(
    key: GraphKey, graph_out: Any, eager_out: Any, config: VerifyConfig
) -> ParityError | None:
    """The error to reject the graph of `key` with when its output differs from eager's."""
    if outputs_match(graph_out, eager_out, config):
        return None
    detail = describe_mismatch(graph_out, eager_out)
    return ParityError(f"graph output differs from eager for {key.describe()}: {detail}")


def max_abs_diffs(a: Any, b: Any) -> list[float]:
    """Per tensor leaf, the largest |a - b| (inf where the leaves differ in shape or dtype, or
    one is NaN where the other is not)."""
    found = []
    for x, y in zip(tree_flatten(a)[0], tree_flatten(b)[0], strict=True):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            found.append(math.inf)
            continue
        wide = torch.promote_types(y.dtype, torch.float64)  # complex stays complex
        x, y = x.to(y.device, wide), y.to(wide)
        both_nan = x.isnan() & y.isnan()
        delta = (x - y).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
        found.append(float(delta.max()) if delta.numel() else 0.0)
    return found


def spread_error(
    key: GraphKey, graph_out: Any, eager_out: Any, spread: list[float]
) -> ParityError | None:
    """The error for a graph farther from eager than eager's own run-to-run `spread`."""
    diffs = max_abs_diffs(graph_out, eager_out)
    over = [(i, d, s) for i, (d, s) in enumerate(zip(diffs, spread, strict=True)) if d > s]
    if not over:
        return None
    detail = "; ".join(f"out{i}: max |diff| {d:.3g} > eager's spread {s:.3g}" for i, d, s in over)
    return ParityError(f"graph output outside eager's spread for {key.describe()}: {detail}")


def _leaf_match(graph: Any, eager: Any, config: VerifyConfig) -> bool:
    if not isinstance(graph, torch.Tensor) or not isinstance(eager, torch.Tensor):
        return bool(graph == eager)
    if graph.shape != eager.shape or graph.dtype != eager.dtype:
        return False
    if graph.device != eager.device:  # a reference kept on the host (graphguard/core/state.py)
        graph = graph.to(eager.device)
    if config.mode == "allclose":
        assert config.rtol is not None and config.atol is not None
        return bool(
            torch.allclose(graph, eager, rtol=config.rtol, atol=config.atol, equal_nan=True)
        )
    return _bitwise_equal(graph, eager)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0:
        return True
    a_bytes = a.contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a_bytes, b_bytes))


def describe_mismatch(graph_out: Any, eager_out: Any) -> str:
    """Where two outputs differ: per leaf, how many elements and by how much (for the log)."""
    parts = []
    graph_leaves, graph_spec = tree_flatten(graph_out)
    eager_leaves, eager_spec = tree_flatten(eager_out)
    if graph_spec != eager_spec:
        return f"the outputs are shaped otherwise: {graph_spec} vs {eager_spec}"
    for i, (g, e) in enumerate(zip(graph_leaves, eager_leaves, strict=True)):
        if not isinstance(g, torch.Tensor) or not isinstance(e, torch.Tensor):
            continue
        if g.shape != e.shape or g.dtype != e.dtype:
            parts.append(f"out{i}: {tuple(g.shape)}/{g.dtype} vs {tuple(e.shape)}/{e.dtype}")
            continue
        g = g.to(e.device)
        differ = g.ne(e) & ~(g.isnan() & e.isnan())  # NOTE: a NaN where eager has one is no diff
        count = int(differ.sum())
        if count:
            wide = torch.promote_types(e.dtype, torch.float64)  # complex stays complex
            delta = (g.to(wide) - e.to(wide)).abs().nan_to_num(nan=float("inf"))[differ].max()
            rows = differ.reshape(differ.shape[0], -1).any(-1).sum() if g.dim() else 1
            where = f"{count}/{g.numel()} elements in {int(rows)} rows"
            parts.append(f"out{i}: {where}, max |diff| {float(delta):.3g}")
    return "; ".join(parts) or "no element differs"
