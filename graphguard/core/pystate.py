"""A step's Python-side state: the plain values it changes on the objects it reaches.

A step may change state that is not in tensors: an int counter on a cache layer (transformers'
sliding-window layers keep `cumulative_length_int` beside their device counter), a list it
appends to, an attribute of a module, a variable its closure rebinds. A graph's replay runs no
Python, so such a change is made by every eager execution and by none of the replays.

`PyState.of(roots)` is a snapshot of what the step reaches from its function and arguments: a
bound method's object, a partial's arguments, a closure's cells and the globals a function's
own code names, and from those every object's
attributes (`__dict__` and `__slots__`) and the contents of lists, dicts, sets and cells,
transitively. Values are compared as values where they are immutable (numbers, strings, tuples
of them, dtypes, devices) and by identity otherwise: a tensor rebound to a new one is a change
(the graph would go on reading the old one), a tensor written in place is not (that is tensor
state, graphguard/core/state.py). `before.changes(after)` lists what differs, each change able
to put its value back (`undo`) and forward again (`redo`).

What is not walked: the runtime's own objects (graphguard.core, graphguard.segmented: their
counters change while a capture runs and are not the step's), compilers' and kernel libraries'
objects (Triton, Numba, torch's internals: caches), modules and classes, a function's globals
beyond the names its own code uses, locks, loggers, and objects past `MAX_OBJECTS` (with a
warning). State there is not found.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import threading
import types
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

log = logging.getLogger("graphguard")

# How many objects a snapshot walks before it stops looking: a model reaches about 16 per
# module (its hook dicts and parameter dicts), so 30 layers of 12 modules are about 6,000; a
# mixture of experts with a module per expert reaches hundreds of thousands (about 1 s a walk).
MAX_OBJECTS = 1_000_000

_VALUES = (
    type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device,
    torch.layout, torch.memory_format,
)  # fmt: skip
# compared by identity, never walked
_OPAQUE = (
    torch.Tensor, type, types.ModuleType, types.BuiltinFunctionType, types.CodeType,
    logging.Logger, torch.Generator, type(threading.Lock()), type(threading.RLock()),
    threading.Condition, threading.Event, threading.Thread,
)  # fmt: skip
# Modules whose objects are never the step's state: the runtime's own bookkeeping, and the
# caches of compilers and kernel libraries (a Triton kernel's compiled variants grow on a new
# specialization; that is no value a replay must change).
_NOT_STATE = ("graphguard.core.", "graphguard.segmented.", "triton.", "numba.", "torch._")
_MISSING = object()  # an attribute that is not there


class _Where(enum.Enum):
    """What of an object a change is in."""

    ATTR = "attr"  # an entry of its __dict__
    SLOT = "slot"  # a __slots__ attribute
    ITEMS = "items"  # a list's, dict's, set's or deque's contents
    CELL = "cell"  # a closure cell's contents


_Slot = tuple[int, "_Where", str]  # (id of the object, what of it, the attribute's name)


@dataclass
class PyChange:
    """One value the step changed: `owner`'s attribute `name` (or its contents), from
    `before` to `after` (copies of contents for containers)."""

    owner: Any
    where: _Where
    name: str
    before: Any
    after: Any

    def undo(self) -> None:
        _put(self.owner, self.where, self.name, self.before)

    def redo(self) -> None:
        _put(self.owner, self.where, self.name, self.after)

    def describe(self) -> str:
        owner = type(self.owner).__name__
        label = f"{owner}.{self.name}" if self.where in (_Where.ATTR, _Where.SLOT) else owner
        return f"{label}: {_short(self.before)} -> {_short(self.after)}"


class PyChanges(list[PyChange]):
    """The Python-side values a step changed (empty: none)."""

    def undo(self) -> None:
        for change in reversed(self):
            change.undo()

    def redo(self) -> None:
        for change in self:
            change.redo()

    def describe(self, most: int = 3) -> str:
        shown = "; ".join(change.describe() for change in self[:most])
        return shown + (f" (and {len(self) - most} more)" if len(self) > most else "")

    def same_as(self, other: PyChanges) -> bool:
        """Whether `other` changed the same values of the same objects to the same values."""
        if len(self) != len(other):
            return False
        theirs = {(id(c.owner), c.where, c.name): c.after for c in other}
        return all(
            _same(change.after, theirs.get((id(change.owner), change.where, change.name), _MISSING))
            for change in self
        )


class PyState:
    """A snapshot of the Python-side values reachable from a step (see module docstring)."""

    def __init__(self, entries: dict[_Slot, Any], owners: dict[int, Any]) -> None:
        self._entries = entries  # (id(owner), where, name) -> the value there
        self._owners = owners  # id -> every object walked (held: the ids stay unique)

    @classmethod
    def of(cls, roots: Iterable[Any], unwatched: Iterable[Any] = ()) -> PyState:
        """What `roots` reach; never what `unwatched` objects hold (declared not the step's
        state: a clock, a stats counter)."""
        entries: dict[_Slot, Any] = {}
        owners: dict[int, Any] = {}
        skipped = {id(obj) for obj in unwatched}
        stack = [child for root in roots for child in _root_children(root)]
        while stack:
            obj = stack.pop()
            if id(obj) in owners or id(obj) in skipped or not _is_walked(obj):
                continue
            if len(owners) >= MAX_OBJECTS:
                log.warning("graphguard: a step reaches over %d objects; the rest of its "
                            "Python-side state is not watched", MAX_OBJECTS)  # fmt: skip
                break
            owners[id(obj)] = obj
            for where, name, value in _fields(obj):
                entries[(id(obj), where, name)] = value
                stack.extend(_contents(value) if where is _Where.ITEMS else _inner(value))
        return cls(entries, owners)

    def changes(self, later: PyState) -> PyChanges:
        """What differs in `later` (taken after the step ran) from this snapshot. Only objects
        reached both times are compared: a new object is a change where it was put, one no
        longer reached a change where it was taken from."""
        found = PyChanges()
        for slot in self._entries.keys() | later._entries.keys():
            owner = self._owners.get(slot[0])
            if owner is None or later._owners.get(slot[0]) is not owner:
                continue
            before = self._entries.get(slot, _MISSING)
            after = later._entries.get(slot, _MISSING)
            if not _same(before, after):
                found.append(PyChange(owner, slot[1], slot[2], before, after))
        return found


def _root_children(root: Any) -> list[Any]:
    """What a step's function or argument reaches first: itself, and for a function what it
    closes over (a bound method's object, a partial's arguments, a closure's cells)."""
    if isinstance(root, types.MethodType):
        return [root.__self__, *_root_children(root.__func__)]
    if isinstance(root, partial):
        return [*_root_children(root.func), *root.args, *root.keywords.values()]
    if isinstance(root, types.FunctionType):
        # what it closes over, and the globals its own code names (never the whole module)
        named = [root.__globals__[n] for n in root.__code__.co_names if n in root.__globals__]
        return [*(root.__closure__ or ()), *named]
    return [root]


def _is_walked(obj: Any) -> bool:
    if isinstance(obj, _VALUES) or isinstance(obj, _OPAQUE) or callable(obj) and _is_plain_fn(obj):
        return False
    return not type(obj).__module__.startswith(_NOT_STATE)


def _is_plain_fn(obj: Any) -> bool:
    return isinstance(obj, (types.FunctionType, types.MethodType, partial))


def _fields(obj: Any) -> list[tuple[_Where, str, Any]]:
    """An object's values: its attributes, and a container's contents (copied)."""
    found: list[tuple[_Where, str, Any]] = []
    if isinstance(obj, types.CellType):
        try:
            return [(_Where.CELL, "", obj.cell_contents)]
        except ValueError:  # an empty cell
            return [(_Where.CELL, "", _MISSING)]
    if isinstance(obj, (list, deque)):
        found.append((_Where.ITEMS, "", list(obj)))
    elif isinstance(obj, dict):
        found.append((_Where.ITEMS, "", dict(obj)))
    elif isinstance(obj, set):
        found.append((_Where.ITEMS, "", set(obj)))
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        found += [(_Where.ATTR, name, value) for name, value in attributes.items()]
    for name in _slots(type(obj)):  # type: ignore[arg-type]  # a class is hashable
        found.append((_Where.SLOT, name, getattr(obj, name, _MISSING)))
    return found


@functools.cache
def _slots(cls: Any) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s != "__dict__"]
    return [name for name in names if name != "__weakref__"]


def _contents(copy: Any) -> list[Any]:
    """What a container's contents lead the walk to."""
    return [*copy.keys(), *copy.values()] if isinstance(copy, dict) else list(copy)


def _inner(value: Any) -> list[Any]:
    """The objects a value leads the walk to: a mutable container is walked as an object
    (its contents are its values), an immutable one through its items."""
    if isinstance(value, (tuple, frozenset)):
        return list(value)
    if isinstance(value, types.FunctionType):
        return list(value.__closure__ or ())  # a hook's closure, never its globals
    if isinstance(value, types.MethodType):
        return [value.__self__]
    if isinstance(value, partial):
        return [value.func, *value.args, *value.keywords.values()]
    return [value]


def _same(a: Any, b: Any) -> bool:
    """Whether a value is unchanged: identical, or equal where it is an immutable value (a NaN
    rebound to another NaN too); contents of containers in their order."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, _VALUES):
        return bool(a == b)
    if isinstance(a, (set, frozenset)):
        return bool(a == b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return False


def _put(owner: Any, where: _Where, name: str, value: Any) -> None:
    """Set one value back (an attribute, a slot, a container's contents in place, a cell)."""
    if where is _Where.ATTR:
        attributes = owner.__dict__
        if value is _MISSING:
            attributes.pop(name, None)
        else:
            attributes[name] = value  # NOTE: not setattr: nn.Module routes tensors elsewhere
    elif where is _Where.SLOT:
        if value is _MISSING:
            if hasattr(owner, name):
                delattr(owner, name)
        else:
            setattr(owner, name, value)
    elif where is _Where.CELL:
        if value is _MISSING:
            del owner.cell_contents
        else:
            owner.cell_contents = value
    # NOTE: the base types' methods: a subclass may refuse its own (transformers' ModelOutput
    # raises on update), and its contents are what was saved
    elif isinstance(owner, dict):
        base = OrderedDict if isinstance(owner, OrderedDict) else dict  # its own bookkeeping
        base.clear(owner)
        base.update(owner, value)
    elif isinstance(owner, set):
        set.clear(owner)
        set.update(owner, value)
    elif isinstance(owner, list):
        list.__setitem__(owner, slice(None), value)
    else:
        owner.clear()
        owner.extend(value)


def _short(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    if isinstance(value, _VALUES):
        text = repr(value)
    elif isinstance(value, (list, dict, set, tuple)):
        text = f"<{type(value).__name__} of {len(value)}>"
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."
