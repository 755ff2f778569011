"""Turning a call's arguments into a graph key, static buffers and sliced outputs."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

from graphguard.core.entry import GraphEntry
from graphguard.core.keys import Buckets, GraphKey, TensorSpec
from graphguard.core.reasons import FallbackReason


@dataclass(frozen=True)
class CallPlan:
    """The key a call maps to, and how many of the padded rows are real."""

    key: GraphKey
    rows: int | None  # real rows (None without buckets)

    @property
    def padded_rows(self) -> int | None:
        return self.key.rows


# How many call signatures a runner remembers the plan of before it starts afresh.
MAX_PLANS = 1024


def call_signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a call's plan depends on: each tensor's shape, dtype and device, and every other
    argument's value. Raises TypeError for an unhashable argument (when used as a key)."""
    return tuple((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


def plan_call(
    args: Sequence[Any], buckets: Buckets | None, device: torch.device, stage_host: bool
) -> CallPlan | FallbackReason:
    """Key the call, or name the reason it cannot replay."""
    # NOTE: on every call's path; one pass over the arguments, no helper calls per tensor.
    rows: int | None = None
    parts: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            arg_device = arg.device
            if arg_device != device and not (stage_host and arg_device.type == "cpu"):
                return FallbackReason.DEVICE_MISMATCH
            shape = arg.shape
            if buckets is not None and shape:
                if rows is None:
                    rows = shape[0]
                elif shape[0] != rows:
                    return FallbackReason.UNBUCKETED_SHAPE  # inputs disagree on rows
            parts.append(_TensorPart(shape, arg.dtype, arg_device))
        else:
            try:
                hash(arg)
            except TypeError:
                return FallbackReason.UNSUPPORTED_INPUT
            parts.append(arg)
    if buckets is None:
        return CallPlan(GraphKey(tuple(_spec(p) for p in parts)), None)
    padded = buckets.bucket_for(rows) if rows is not None else None
    if padded is None:
        return FallbackReason.UNBUCKETED_SHAPE
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and not buckets.has_pad_for(position):
            return FallbackReason.UNSUPPORTED_INPUT  # no declared pad value for it
    key = GraphKey(tuple(_spec(p, padded) for p in parts), padded)
    return CallPlan(key, rows)


class _TensorPart(NamedTuple):
    """A tensor argument's shape, dtype and device (a constant argument may be a tuple too)."""

    shape: Any
    dtype: torch.dtype
    device: torch.device


def _spec(part: Any, padded: int | None = None) -> Any:
    if not isinstance(part, _TensorPart):
        return part
    shape, dtype, device = part
    if padded is not None and shape:
        return TensorSpec((padded, *shape[1:]), dtype, device)
    return TensorSpec(tuple(shape), dtype, device)


def padding_example(key: GraphKey, buckets: Buckets | None) -> tuple[Any, ...]:
    """Arguments of `key` whose every row is padding: each tensor filled with the pad value of
    its position (0 without buckets, or where Buckets has none); constants as the key holds."""

    def pad(position: int) -> float | int:
        if buckets is None or not buckets.has_pad_for(position):
            return 0
        return buckets.pad_for(position)

    return tuple(
        torch.full(a.shape, pad(i), dtype=a.dtype, device=a.device)
        if isinstance(a, TensorSpec)
        else a
        for i, a in enumerate(key.args)
    )


def make_static_args(
    entry: GraphEntry,
    args: Sequence[Any],
    plan: CallPlan,
    buckets: Buckets | None,
    own: Collection[int] = (),
) -> list[Any]:
    """Allocate the entry's static inputs on its device and fill them from `args`. The args
    at positions `own` (tensors that outlive the entry and hold each call's value when it
    replays: the static outputs of the graph before it in a group) are their own static
    inputs."""
    device = entry.backend.device
    static: list[Any] = []
    # NOTE: in the entry's pool, on its stream: the buffers are charged and freed with the graph.
    with entry.allocating():
        for position, (arg, part) in enumerate(zip(args, plan.key.args, strict=True)):
            if position in own:
                static.append(arg)
            elif isinstance(part, TensorSpec):
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
        entry.wait_staging()
    padded = plan.rows is None or plan.rows == plan.padded_rows
    for position, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        static = entry.static_args[position]
        if static is arg:
            continue  # a reused tensor (make_static_args), or a call of the static inputs
        staging = entry.staging.get(position)
        if staging is not None:
            _fill(staging, arg, None if padded or arg.dim() == 0 else plan.rows, buckets, position)
            static.copy_(staging, non_blocking=True)
        elif padded or arg.dim() == 0:
            static.copy_(arg)  # the common case: the call fills its bucket
        else:
            _fill(static, arg, plan.rows, buckets, position)


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
    if not copy and (rows is None or rows == padded):
        return outputs  # nothing to slice or copy: the static outputs themselves
    if isinstance(outputs, torch.Tensor):
        if rows is not None and outputs.dim() > 0 and outputs.shape[0] == padded:
            outputs = outputs[:rows]
        return outputs.clone() if copy else outputs

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if padded is not None and rows is not None and t.dim() > 0 and t.shape[0] == padded:
            t = t[:rows]
        return t.clone() if copy else t

    return tree_map(one, outputs)
