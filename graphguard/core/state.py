"""A step's state: the tensors it writes besides its outputs, and how a capture puts them back.

Contract: **a capture attempt never changes what the caller observes.** A capture runs the step
several times for one call (its check against eager, warm-ups, the first replay). A step that
writes in place (a KV cache at a counter, the counter itself: Hugging Face's StaticCache) would
append once per run. So the capture watches one eager run of the step under a dispatch mode
(`watch_step`, the *record run*): every in-place write an op makes to a tensor that existed
before the step is the step's state, and before the op runs the region it will write is saved
(an `index_copy_` saves the few slots it writes, a counter one element; any other write the
view it writes). `StepState.undo()` writes the saved regions back, last first, so each later
run starts from the state the call found, and the capture leaves the state exactly as one
execution would.

What cannot be put back is refused, with a named reason, before it is written (the record run
stops there and is undone): a write to a tensor on another device than the graphs' (a host
tensor: `unownable_state`), to the step's own inputs (a graph writes its static copies, never
the caller's tensors: `unownable_state`), outside a declared state (`undeclared_state`), or past
`max_state_bytes` of saved regions (`state_too_large`). A step that keeps tensors it created
(a cache that grows by concatenation: state in Python objects, which a graph would replay at
stale addresses) is found after the record run and refused (`python_state`); that run then
answers the call, so the step still ran once.

Writes made by kernels outside PyTorch's dispatcher (a raw Triton launch) are not seen: they
must write the same values each time the step runs (the engine's KV writes do), or be declared.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from graphguard.core.holes import HoleLog, taking_holes
from graphguard.core.pystate import PyChanges, PyState
from graphguard.core.reasons import FallbackReason

_INDEX_COPY = torch.ops.aten.index_copy_.default
_INDEX_PUT = torch.ops.aten.index_put_.default
_INDEX = torch.ops.aten.index.Tensor


class StateRefused(Exception):
    """The step writes state a capture cannot put back; `reason` names why."""

    def __init__(self, reason: FallbackReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


@dataclass
class StateOptions:
    """How a capture treats the step's state: the bytes it may save, when declared the tensors
    it may write (a write outside them is refused), and the objects whose Python-side values
    are not its state (never walked: graphguard/core/pystate.py)."""

    max_state_bytes: int = 1 << 30
    declared: tuple[torch.Tensor, ...] | None = None
    unwatched: tuple[Any, ...] = ()


class _Write:
    """One region the step wrote, with what it held before."""

    def __init__(self, func: Any, target: torch.Tensor, args: tuple[Any, ...]) -> None:
        self.target = target
        self.index: Any = None
        if func is _INDEX_COPY:
            self.dim, self.index = args[1], args[2].clone()
        elif func is _INDEX_PUT:  # NOTE: accumulated or not, the indexed elements are written
            self.dim, self.index = None, [None if i is None else i.clone() for i in args[1]]
        self.before = self.region().clone()

    @property
    def num_bytes(self) -> int:
        return self.before.numel() * self.before.element_size()

    def region(self) -> torch.Tensor:
        """The written region as it is now."""
        if self.index is None:
            return self.target
        if self.dim is not None:
            return self.target.index_select(self.dim, self.index)
        return _INDEX(self.target, self.index)

    def undo(self) -> None:
        if self.index is None:
            self.target.copy_(self.before)
        elif self.dim is not None:
            self.target.index_copy_(self.dim, self.index, self.before)
        else:  # NOTE: the op itself: its indices may hold None (a slice), the method's may not
            _INDEX_PUT(self.target, self.index, self.before)


@dataclass
class StepState:
    """The regions one execution of a step writes, the Python-side values it changes, and
    whether the state now holds that execution's changes (`is_written`)."""

    writes: list[_Write] = field(default_factory=list)
    python: PyChanges = field(default_factory=PyChanges)
    is_written: bool = True

    @property
    def num_bytes(self) -> int:
        """Bytes of saved regions (transient device memory while a capture runs)."""
        return sum(write.num_bytes for write in self.writes)

    @property
    def is_empty(self) -> bool:
        return not self.writes and not self.python

    def undo(self) -> None:
        """Put back what the step's execution wrote and changed (idempotent until it runs
        again)."""
        if self.is_written:
            for write in reversed(self.writes):
                write.undo()
            self.python.undo()
            self.is_written = False

    def written(self) -> None:
        """The step ran once more from the undone state (a replay, a warm-up)."""
        self.is_written = True

    def regions(self, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Copies of the written regions as they are now (what an execution left there), on
        `device` (default: where they live)."""
        return [write.region().to(device, copy=True) for write in self.writes]


@dataclass
class Recorded:
    """The record run: its outputs, the state it wrote, the regions after it (copies, on the
    host), the Python-side values as it found them, and its holes (graphguard/core/holes.py)."""

    outputs: Any
    state: StepState
    after: list[torch.Tensor]
    python_before: PyState
    holes: HoleLog

    def python_differs(self, roots: Sequence[Any], unwatched: Sequence[Any]) -> PyChanges | None:
        """What a replay changed of the Python-side values, where that is not what the record
        run changed (a replay's holes must change them as eager did); None where it is."""
        now = self.python_before.changes(PyState.of(roots, unwatched))
        return None if now.same_as(self.state.python) else now

    def python_error(self, replayed: PyChanges) -> str:
        """The refusal's words for a replay that changed `replayed`."""
        return (
            f"a replay leaves the Python-side values as {replayed.describe() or 'they were'}, "
            f"eager as {self.state.python.describe()}"
        )


class _Watch(TorchDispatchMode):
    """Logs, before each op runs, the regions it writes in tensors that existed before the
    step; remembers the tensors the step creates (to find those it keeps)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: the mode's hook to opt out of being wrapped for dynamo: the wrapper imports
        # torch._dynamo on first use (1-5 s, counted as capture work); nothing here compiles.
        # It runs when the class is made, before mutation testing could swap it.
        return False  # pragma: no mutate

    def __init__(self, device: torch.device, inputs: Sequence[Any], options: StateOptions):
        super().__init__()
        self.device = _indexed(device)
        self.options = options
        self.input_storages = {_storage(t) for t in inputs if isinstance(t, torch.Tensor)}
        self.declared = (
            None if options.declared is None else {_storage(t) for t in options.declared}
        )
        self.created: set[int] = set()  # storages the step allocated
        self.made: list[weakref.ref[torch.Tensor]] = []  # tensors the step allocated
        self.state = StepState()

    def is_made(self, tensor: torch.Tensor) -> bool:
        """Whether the step allocated `tensor`'s storage (it did not exist before)."""
        return _storage(tensor) in self.created

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                for target in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(target, torch.Tensor):
                        self._before_write(func, target, args)
        out = func(*args, **kwargs)
        if all(r.alias_info is None for r in func._schema.returns):
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.created.add(_storage(tensor))
                    self.made.append(weakref.ref(tensor))
        return out

    def _before_write(self, func: Any, target: torch.Tensor, args: tuple[Any, ...]) -> None:
        storage = _storage(target)
        if storage in self.created:
            return  # a temporary of the step
        if target.device != self.device:
            raise StateRefused(FallbackReason.UNOWNABLE_STATE, f"writes a {target.device} tensor")
        if storage in self.input_storages:
            raise StateRefused(FallbackReason.UNOWNABLE_STATE, "writes its own inputs in place")
        if self.declared is not None and storage not in self.declared:
            raise StateRefused(
                FallbackReason.UNDECLARED_STATE,
                f"{func} writes a tensor outside the declared state",
            )
        write = _Write(func, target, args)
        if self.state.num_bytes + write.num_bytes > self.options.max_state_bytes:
            raise StateRefused(
                FallbackReason.STATE_TOO_LARGE,
                f"saving what it writes takes over {self.options.max_state_bytes} bytes",
            )
        self.state.writes.append(write)

    def kept(self, outputs: Any, keep: Sequence[Any]) -> list[torch.Tensor]:
        """Tensors the step created that Python objects still hold, and that are neither its
        outputs nor held here: state in Python objects (a cache grown by concatenation).

        NOTE: a tensor that only native code holds (a collective's pending work, say) has no
        Python referrer: it is not the step's state, and is not counted."""
        mine = {id(t) for t in keep}  # the outputs, and their views, by their storage
        out_storages = {_storage(t) for t in tree_flatten(outputs)[0] if _is_tensor(t)}
        found = [ref() for ref in self.made]
        alive = [
            t
            for t in found
            if t is not None and id(t) not in mine and _storage(t) not in out_storages
        ]
        del found
        if not alive:
            return []
        gc.collect()  # NOTE: a temporary in a reference cycle is alive until collected
        # NOTE: held by a Python object other than a running frame or `alive` (written inline:
        # a helper's own arguments would refer to the tensor it is asked about)
        return [
            t
            for t in alive
            if any(
                r is not alive and not isinstance(r, types.FrameType) for r in gc.get_referrers(t)
            )
        ]


def watch_step(
    fn: Callable[..., Any], args: Sequence[Any], device: torch.device, options: StateOptions
) -> Recorded:
    """Run `fn(*args)` once eagerly, finding its state (see module docstring). Raises
    StateRefused with the state undone for what cannot be put back, or, for Python-side state
    (found after the run), with the run's outputs as `outputs` of the exception."""
    roots = (fn, *args)
    python_before = PyState.of(roots, options.unwatched)
    watch = _Watch(device, args, options)
    holes = HoleLog(watch.is_made)
    try:
        with torch.no_grad(), watch, taking_holes(holes):
            raw = fn(*args)
    except BaseException:  # a refusal (raised before its write) or the step's own error
        watch.state.undo()
        raise
    # NOTE: the record run's outputs and what it wrote are kept on the host until the check:
    # held on the device through the warm-ups and the capture, they would add their bytes to
    # the device's peak while the graph's pool grows.
    keep = [w.target for w in watch.state.writes] + [w.index for w in watch.state.writes]
    keep += tree_flatten([(c.args, c.kwargs, c.results) for c in holes.calls])[0]
    kept = watch.kept(raw, [k for k in keep if _is_tensor(k)])
    if kept:
        raise PythonState(
            f"the step kept {len(kept)} tensors it created (state held in Python objects, "
            "such as a cache that grows by concatenation)",
            raw,
        )
    watch.state.python = python_before.changes(PyState.of(roots, options.unwatched))
    if watch.state.python and not holes.calls:
        raise PythonState(
            f"the step changes Python-side values a replay would not: "
            f"{watch.state.python.describe()}",
            raw,
        )
    outputs = tree_map(lambda t: t.detach().to("cpu", copy=True) if _is_tensor(t) else t, raw)
    return Recorded(outputs, watch.state, watch.state.regions("cpu"), python_before, holes)


class PythonState(StateRefused):
    """The step keeps state in Python objects, which a replay would not change: tensors it
    created and kept (a cache grown by concatenation), or plain values it changed outside a
    hole (a counter). The record run stands as the call's execution: `outputs` answer it."""

    def __init__(self, detail: str, outputs: Any) -> None:
        super().__init__(FallbackReason.PYTHON_STATE, detail)
        self.outputs = outputs


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" is the current CUDA device, as a tensor's is named)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
