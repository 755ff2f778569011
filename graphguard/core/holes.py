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
        fresh = tree_flatten(self.fn(*self.args, **self.kwargs))[0]
        if len(fresh) != len(self.results):
            raise HoleMismatch(
                f"{_name(self.fn)} returned {len(fresh)} values, not {len(self.results)}"
            )
        for kept, new, made in zip(self.results, fresh, self.made, strict=True):
            if new is kept or not isinstance(kept, torch.Tensor):
                continue
            if not made or not isinstance(new, torch.Tensor) or new.shape != kept.shape:
                raise HoleMismatch(
                    f"{_name(self.fn)} returned another tensor than at capture, where the "
                    "graph after it reads that one"
                )
            kept.copy_(new)


@dataclass
class HoleLog:
    """A record run's holes, in order: what each returned and which results it made (the
    watch's `is_new` tells a tensor made during the step from one that existed before)."""

    is_new: Callable[[torch.Tensor], bool]
    calls: list[HoleCall] = field(default_factory=list)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = fn(*args, **kwargs)
        results, spec = tree_flatten(out)
        made = [isinstance(r, torch.Tensor) and self.is_new(r) for r in results]
        self.calls.append(HoleCall(fn, args, kwargs, results, made, spec))
        return out


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


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
