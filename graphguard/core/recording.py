"""How the CPU stand-in captures a step: the host syncs a CUDA capture rejects, and two kinds of
simulated graph.

A **recorded graph** (the default) is what a CUDA graph is: the ops the step ran at capture, run
again at every replay without the step's Python. Capture runs the step once under a dispatch
mode that records each ATen op with what it got: a tensor the step made earlier is a slot
filled at replay by the op that made it, anything else is kept as the object it was (a weight,
a cache, a static input: by identity; a number: as the constant it was). What a CUDA graph gets
wrong, a recorded graph gets wrong the same way: a Python branch taken at capture is taken at
every replay, a host value read at capture is baked in, a tensor rebound after capture is not
the one the graph reads or writes, and Python state the step changes is not changed. A hole
(graphguard/core/holes.py) is recorded as a call made at every replay.

A **rerun graph** runs the step's Python again at every replay: kept for steps made of work the
dispatcher does not see (a raw Triton or Numba launch), which a recording would miss.

Both write the step's outputs into the same static tensors at every replay, so aliasing and
overwrite-on-next-replay behave as on CUDA.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from graphguard.core.holes import check_results, taking_holes

# Ops that synchronize with the host, so a CUDA stream capture rejects them.
_HOST_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_dim",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::equal",
    "aten::is_nonzero",
    "aten::allclose",
}


class RejectHostSync(TorchDispatchMode):
    """Rejects host syncs like a capturing CUDA stream, and tracks the peak of live bytes.

    A CUDA graph's private pool reuses blocks freed during capture, so its size follows the
    peak of memory alive at once, not the sum of every allocation; the simulation follows it
    the same way (storages that an op's output shares with its inputs are views, not new).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_SYNC_OPS or (name == "aten::repeat_interleave" and not kwargs):
            raise RuntimeError(
                f"operation not permitted when stream is capturing ({name} synchronizes with "
                "the host)"
            )
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if _is_tensor(t) and _storage(t) not in inputs:
                self._track(t)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        ptr = _storage(tensor)
        if ptr in self.live:
            return
        nbytes = tensor.untyped_storage().nbytes()
        self.live[ptr] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(tensor, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.live_bytes -= self.live.pop(ptr, 0)


@dataclass(frozen=True)
class _Slot:
    """A tensor the step made at capture: filled at each replay by the op that makes it."""

    index: int


@dataclass
class _Recorded:
    """One recorded op or hole: what it is called with (slots and kept objects, flattened),
    and the slot each of its results fills (None: a result that needs none)."""

    fn: Callable[..., Any]
    spec: TreeSpec  # how `leaves` make (args, kwargs)
    leaves: list[Any]
    fills: list[int | None]
    returned: list[Any] | None = None  # a hole: what it returned at capture
    frees: tuple[int, ...] = ()  # slots no later step reads

    def run(self, values: list[Any]) -> None:
        args, kwargs = tree_unflatten(
            [values[v.index] if isinstance(v, _Slot) else v for v in self.leaves], self.spec
        )
        results = tree_flatten(self.fn(*args, **kwargs))[0]
        if self.returned is not None:
            check_results(self.fn, results, self.returned, [f is not None for f in self.fills])
        for slot, result in zip(self.fills, results, strict=True):
            if slot is not None:
                values[slot] = result
            elif _is_work(result):
                # NOTE: a collective returns its work, which eager's torch.distributed call
                # waited on before the step went on (outside the dispatcher); a CUDA graph
                # orders it on the stream instead
                result.wait()
        for slot in self.frees:
            values[slot] = None


class Recorder(RejectHostSync):
    """Records the ops a step runs, and its holes, run as they come (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[_Recorded] = []
        self._slots: dict[int, int] = {}  # id of a live tensor the step made -> its slot
        self.num_slots = 0
        self._hole_made: set[int] | None = None  # while a hole runs: ids of what it makes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._hole_made is not None:  # a hole runs as eager Python: none of it is recorded
            out = func(*args, **kwargs)
            self._hole_made.update(id(t) for t in tree_flatten(out)[0] if _is_tensor(t))
            return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._record(func, (args, kwargs), out, None)
        return out

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A hole: run now, recorded to run again at every replay."""
        made: set[int] = set()
        self._hole_made = made
        try:
            with taking_holes(None):  # a hole inside a hole is part of it
                out = fn(*args, **kwargs)
        finally:
            self._hole_made = None
        self._record(fn, (args, kwargs), out, made | set(self._slots))
        return out

    def _record(self, fn: Callable[..., Any], call: Any, out: Any, hole: set[int] | None) -> None:
        """Record an op, or a hole (`hole`: the ids of the tensors it made, and of those the
        step made before it: only those fill a slot; any other tensor it returns must come
        back at every replay, as the same memory)."""
        leaves, spec = tree_flatten(call)
        refs = [self._ref(leaf) for leaf in leaves]
        results = tree_flatten(out)[0]
        fills = [
            self._fill(r, leaves) if _is_tensor(r) and (hole is None or id(r) in hole) else None
            for r in results
        ]
        self.steps.append(_Recorded(fn, spec, refs, fills, None if hole is None else results))

    def _ref(self, leaf: Any) -> Any:
        if _is_tensor(leaf):
            slot = self._slots.get(id(leaf))
            if slot is not None:
                return _Slot(slot)
        return leaf  # kept as it is: a tensor from before the step, or a constant

    def _fill(self, result: torch.Tensor, leaves: list[Any]) -> int | None:
        """The slot a result fills: its own if the step made it here (an in-place op returns
        its argument, which keeps its own slot or stays the object it is)."""
        if any(result is leaf for leaf in leaves):
            return self._slots.get(id(result))
        if id(result) in self._slots:
            return self._slots[id(result)]
        slot = self.num_slots
        self.num_slots += 1
        self._slots[id(result)] = slot
        weakref.finalize(result, self._slots.pop, id(result), None)
        return slot

    def graph(self, outputs: Any) -> RecordedGraph:
        """The recording as a graph whose replays write `outputs` (the static outputs, copies
        of what the capture returned)."""
        leaves = [self._ref(t) for t in tree_flatten(outputs)[0]]
        return RecordedGraph(self.steps, leaves, self.num_slots)


class RecordedGraph:
    """The steps a capture recorded, replayed in order (see module docstring)."""

    def __init__(self, steps: list[_Recorded], outputs: list[Any], num_slots: int) -> None:
        self.steps: list[_Recorded] | None = steps
        self._outputs = outputs  # per output leaf: its slot, or the object the step returned
        self._num_slots = num_slots
        self.static_outputs: list[torch.Tensor] = []
        _set_frees(steps, outputs)

    @property
    def num_holes(self) -> int:
        return sum(step.returned is not None for step in self.steps or ())

    def replay(self) -> None:
        if self.steps is None:
            raise RuntimeError("replay of a RecordedGraph after reset")
        values: list[Any] = [None] * self._num_slots
        with torch.no_grad():
            for step in self.steps:
                step.run(values)
            for static, out in zip(self.static_outputs, self._outputs, strict=True):
                static.copy_(values[out.index] if isinstance(out, _Slot) else out)

    def reset(self) -> None:
        self.steps = None
        self.static_outputs = []


class RerunGraph:
    """A simulated graph that re-runs the step's Python at every replay (see module docstring)."""

    def __init__(self, fn: Callable[..., Any], args: list[Any]):
        self.fn: Callable[..., Any] | None = fn
        self.args: list[Any] | None = args
        self.static_outputs: list[torch.Tensor] = []

    def replay(self) -> None:
        if self.fn is None or self.args is None:
            raise RuntimeError("replay of a RerunGraph after reset")
        with torch.no_grad():
            fresh = self.fn(*self.args)
        for static, new in zip(self.static_outputs, tree_flatten(fresh)[0], strict=True):
            static.copy_(new)

    def reset(self) -> None:
        self.fn = self.args = None
        self.static_outputs = []


def _set_frees(steps: list[_Recorded], outputs: list[Any]) -> None:
    """Let each slot go after the last step that reads it (the outputs' slots stay)."""
    last: dict[int, int] = {}
    for position, step in enumerate(steps):
        for leaf in step.leaves:
            if isinstance(leaf, _Slot):
                last[leaf.index] = position
    kept = {out.index for out in outputs if isinstance(out, _Slot)}
    frees: dict[int, list[int]] = {}
    for slot, position in last.items():
        if slot not in kept:
            frees.setdefault(position, []).append(slot)
    for position, slots in frees.items():
        steps[position].frees = tuple(slots)


def _is_work(value: Any) -> bool:
    """A collective's pending work (torch.distributed's Work)."""
    return not _is_tensor(value) and callable(getattr(value, "wait", None))


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
