"""Eager holes: calls inside a captured step that run as Python at every replay.

A step calls `hole(fn, *args, **kwargs)` where a part of it must run eagerly on every execution:
a cache update that keeps a Python counter beside its tensors (transformers' sliding-window
layers), experts fetched from the host. Outside a capture that is just `fn(*args, **kwargs)`.
A backend capturing the step splits it there: a graph up to the hole, the call kept, the next
graph after it. A replay replays each graph and makes each call between them, so the hole's
tensor writes and Python-side changes happen at every replay as they do in eager.

A call keeps the arguments it got at capture: tensors the graph before it writes at their fixed
addresses on every replay, and whatever else it was given. What it returns feeds the graph after
it, which reads fixed addresses too: a tensor that existed before the step (a cache's keys) must
come back as that same tensor at every replay; a tensor the call made is copied into the one
the capture saw. Anything else is a HoleMismatch (the replay cannot go on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


class HoleSink(Protocol):
    """Where a capture (or a record run) takes a step's holes."""

    def call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...


# NOTE: set only while a backend captures a step or a record run watches one, on that thread
# (a ContextVar, so no other thread's step is split).
_SINK: ContextVar[HoleSink | None] = ContextVar("graphguard_hole_sink", default=None)


def hole(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, run eagerly at every replay of a graph captured around it (see
    module docstring)."""
    sink = _SINK.get()
    if sink is None:
        return fn(*args, **kwargs)
    return sink.call(fn, args, kwargs)


@contextmanager
def taking_holes(sink: HoleSink | None) -> Iterator[None]:
    """Holes called inside go to `sink` (None: they run as plain calls)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


class HoleMismatch(RuntimeError):
    """A hole returned, at a replay, what the graph after it cannot read."""


@dataclass
class HoleCall:
    """One hole of a captured step: the call, and the tensors the graph after it reads.

    `made[i]` is True where the capture's result `results[i]` was made by the call (a replay
    copies the new result into it), False where it existed before (it must come back)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    results: list[Any] = field(default_factory=list)
    made: list[bool] = field(default_factory=list)
    spec: TreeSpec | None = None  # how `results` make the call's return value

    def returned(self) -> Any:
        """What the call returned at capture, rebuilt from `results`."""
        assert self.spec is not None
        return tree_unflatten(self.results, self.spec)

    def run(self) -> None:
        """Make the call again, as a replay does; its results go where the capture's were."""
        with taking_holes(None):
            fresh = tree_flatten(self.fn(*self.args, **self.kwargs))[0]
        check_results(self.fn, fresh, self.results, self.made)
        for kept, new, made in zip(self.results, fresh, self.made, strict=True):
            if made and new is not kept:
                kept.copy_(new)


def check_results(
    fn: Callable[..., Any], fresh: list[Any], returned: list[Any], made: list[bool]
) -> None:
    """HoleMismatch unless a replay's results of a hole can feed the graph after it: as many;
    a value that is no tensor equal to the capture's; a tensor the call made alike in shape,
    dtype and device (it is copied in); any other tensor the capture's own memory (the same
    tensor, or a view of it alike)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if len(fresh) != len(returned):
        raise HoleMismatch(f"{name} returned {len(fresh)} values, not {len(returned)}")
    for new, old, is_made in zip(fresh, returned, made, strict=True):
        if not isinstance(old, torch.Tensor):
            if not (new is old or (not isinstance(new, torch.Tensor) and new == old)):
                raise HoleMismatch(f"{name} returned {new!r} where the capture saw {old!r}")
        elif not isinstance(new, torch.Tensor) or not _fits(new, old, is_made):
            raise HoleMismatch(
                f"{name} returned another tensor than at capture, where the graph after it "
                "reads that one"
            )


def _fits(new: torch.Tensor, old: torch.Tensor, is_made: bool) -> bool:
    if new is old:
        return True
    alike = new.shape == old.shape and new.dtype == old.dtype and new.device == old.device
    if is_made:
        return alike
    return alike and new.data_ptr() == old.data_ptr() and new.stride() == old.stride()


@dataclass
class HoleLog:
    """A record run's holes, in order: what each returned and which results it made (the
    watch's `is_new` tells a tensor made during the step from one that existed before)."""

    is_new: Callable[[torch.Tensor], bool]
    calls: list[HoleCall] = field(default_factory=list)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with taking_holes(None):  # a hole inside a hole is part of it
            out = fn(*args, **kwargs)
        results, spec = tree_flatten(out)
        made = [isinstance(r, torch.Tensor) and self.is_new(r) for r in results]
        self.calls.append(HoleCall(fn, args, kwargs, results, made, spec))
        return out


class SplitGraph:
    """A step captured as graphs with holes between them: a replay replays each graph in order
    and makes the hole's call after it (graph 0, hole 0, graph 1, ..., the last graph)."""

    def __init__(self, graphs: list[Any], calls: list[HoleCall]) -> None:
        if len(graphs) != len(calls) + 1:
            raise ValueError(f"{len(graphs)} graphs cannot have {len(calls)} holes between them")
        self.graphs = graphs
        self.calls = calls

    @property
    def num_holes(self) -> int:
        return len(self.calls)

    def replay(self) -> None:
        for graph, call in zip(self.graphs, self.calls, strict=False):
            graph.replay()
            call.run()
        self.graphs[-1].replay()

    def reset(self) -> None:
        for graph in self.graphs:
            graph.reset()
        self.calls = []
