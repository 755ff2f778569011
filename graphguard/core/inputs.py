"""Turning a call's arguments into a graph key, static buffers and sliced outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from graphguard.core.entry import GraphEntry
from graphguard.core.keys import Buckets, GraphKey, TensorSpec, spec_of
from graphguard.core.reasons import FallbackReason


@dataclass(frozen=True)
class CallPlan:
    """The key a call maps to, and how many of the padded rows are real."""

    key: GraphKey
    rows: int | None  # real rows (None without buckets)

    @property
    def padded_rows(self) -> int | None:
        return self.key.rows


def plan_call(
    args: Sequence[Any], buckets: Buckets | None, device: torch.device, stage_host: bool
) -> CallPlan | FallbackReason:
    """Key the call, or name the reason it cannot replay."""
    rows = _batch_rows(args) if buckets is not None else None
    padded: int | None = None
    if buckets is not None:
        if rows is None:
            return FallbackReason.UNBUCKETED_SHAPE
        padded = buckets.bucket_for(rows)
        if padded is None:
            return FallbackReason.UNBUCKETED_SHAPE
    parts: list[Any] = []
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if arg.device != device and not (stage_host and arg.device.type == "cpu"):
                return FallbackReason.DEVICE_MISMATCH
            if buckets is not None and not buckets.has_pad_for(position):
                return FallbackReason.UNSUPPORTED_INPUT  # no declared pad value for it
            parts.append(spec_of(arg, padded if arg.dim() > 0 else None))
        else:
            try:
                hash(arg)
            except TypeError:
                return FallbackReason.UNSUPPORTED_INPUT
            parts.append(arg)
    return CallPlan(GraphKey(tuple(parts), padded), rows)


def _batch_rows(args: Sequence[Any]) -> int | None:
    """Dimension 0 shared by every batched tensor argument, or None if they disagree."""
    sizes = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def make_static_args(
    entry: GraphEntry, args: Sequence[Any], plan: CallPlan, buckets: Buckets | None
) -> list[Any]:
    """Allocate the entry's static inputs on its device and fill them from `args`."""
    device = entry.backend.device
    static: list[Any] = []
    for position, (arg, part) in enumerate(zip(args, plan.key.args, strict=True)):
        if isinstance(part, TensorSpec):
            buffer = torch.empty(part.shape, dtype=part.dtype, device=device)
            if part.device != device:
                entry.add_staging(position, buffer)
            static.append(buffer)
        else:
            static.append(arg)
    entry.static_args = static
    copy_inputs(entry, args, plan, buckets)
    return static


def copy_inputs(
    entry: GraphEntry, args: Sequence[Any], plan: CallPlan, buckets: Buckets | None
) -> None:
    """Copy the call's tensors into the static inputs, padding the rows past the real ones."""
    if entry.staging:
        # NOTE: the previous replay may still be reading a staging buffer through an
        # asynchronous copy; wait for it before the host overwrites the buffer.
        entry.wait_idle()
    for position, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        static = entry.static_args[position]
        rows = plan.rows if arg.dim() > 0 else None
        staging = entry.staging.get(position)
        if staging is not None:
            _fill(staging, arg, rows, buckets, position)
            static.copy_(staging, non_blocking=True)
        else:
            _fill(static, arg, rows, buckets, position)


def _fill(
    dst: torch.Tensor, src: torch.Tensor, rows: int | None, buckets: Buckets | None, position: int
) -> None:
    if rows is None or buckets is None:
        dst.copy_(src)
        return
    dst[:rows].copy_(src)
    if rows < dst.shape[0]:
        dst[rows:].fill_(buckets.pad_for(position))


def slice_outputs(outputs: Any, plan: CallPlan, copy: bool) -> Any:
    """Slice every output whose dimension 0 is the padded batch back to the real rows."""
    padded, rows = plan.padded_rows, plan.rows

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if padded is not None and rows is not None and t.dim() > 0 and t.shape[0] == padded:
            t = t[:rows]
        return t.clone() if copy else t

    return tree_map(one, outputs)
