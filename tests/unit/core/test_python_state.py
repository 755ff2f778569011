"""A step's Python-side state (graphguard/core/pystate.py): what a step changes outside tensors
is found by its record run; a capture that a replay could not keep it right is refused, and the
record run answers the call."""

from __future__ import annotations

import types

import pytest
import torch

import graphguard as gg
import graphguard.core.pystate as pystate
from graphguard.core.pystate import PyState
from graphguard.core.state import PythonState, StateOptions, watch_step
from tests.unit.core.stand_ins import kernel

EAGER_FIRST = gg.AdmissionConfig(min_hits=1)


class Counted(torch.nn.Module):
    """A module that counts its calls in a Python int (`self.n += 1` in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.linear(x) * 2


def calls(count: int) -> list[torch.Tensor]:
    return [torch.full((1, 4), float(i)) for i in range(count)]


def test_a_step_that_counts_in_python_is_refused_and_runs_once_a_call():
    graphed, twin = Counted(), Counted()
    twin.load_state_dict(graphed.state_dict())
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    with torch.no_grad():
        got = [runner(x) for x in calls(12)]
        expected = [twin(x) for x in calls(12)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert graphed.n == twin.n == 12
    stats = runner.stats()
    assert stats["fallbacks"] == {"python_state": 12} and stats["captures"] == 0


def test_the_refusal_names_the_value_that_changed(caplog):
    runner = gg.GraphRunner(Counted(), backend="sim", admission=EAGER_FIRST)
    with torch.no_grad():
        runner(torch.ones(1, 4))
    assert "Counted.n: 0 -> 1" in caplog.text


def test_a_list_the_step_appends_to_is_its_state():
    seen: list[int] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return x + 1

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    for x in calls(3):
        runner(x)
    assert seen == [1, 1, 1] and runner.stats()["fallbacks"] == {"python_state": 3}


def test_a_variable_its_closure_rebinds_is_its_state():
    count = 0

    def step(x: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return x + 1

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    for x in calls(3):
        runner(x)
    assert count == 3 and runner.stats()["fallbacks"] == {"python_state": 3}


SETTINGS = {"scale": 1.0}


def test_a_global_its_code_names_is_walked():
    def step(x: torch.Tensor) -> torch.Tensor:
        SETTINGS["scale"] += 1.0
        return x * 2

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    runner(torch.ones(1, 4))
    assert runner.stats()["fallbacks"] == {"python_state": 1} and SETTINGS["scale"] == 2.0


def test_a_tensor_rebound_to_a_new_one_is_a_change():
    class Rebinds:
        def __init__(self) -> None:
            self.buffer = torch.zeros(4)
            self.spare = torch.ones(4)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.buffer, self.spare = self.spare, self.buffer  # no tensor made: a swap
            return x + self.buffer

    runner = gg.GraphRunner(Rebinds(), backend="sim", admission=EAGER_FIRST)
    runner(torch.ones(4))
    assert runner.stats()["fallbacks"] == {"python_state": 1}


def test_objects_declared_unwatched_are_not_the_steps_state():
    class Stats:
        def __init__(self) -> None:
            self.calls = 0

    stats = Stats()

    def step(x: torch.Tensor) -> torch.Tensor:
        stats.calls += 1  # counted when the step's Python runs; a replay runs none
        return x * 2

    capture = gg.CaptureConfig(unwatched=[stats])
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, capture=capture)
    for x in calls(4):
        assert torch.equal(runner(x), x * 2)
    assert runner.stats()["replays"] == 4 and stats.calls == 2  # the record run, the capture


def test_the_runtimes_own_objects_are_not_walked():
    off = gg.CaptureConfig(enabled=False)
    other = gg.GraphRunner(lambda x: x + 1, backend="sim", capture=off)

    def step(x: torch.Tensor) -> torch.Tensor:
        return other(x) * 2  # the other runner counts its calls: not this step's state

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    for x in calls(3):
        assert torch.equal(runner(x), (x + 1) * 2)
    assert runner.stats()["fallbacks"] == {}


def test_a_value_set_again_to_what_it_was_is_no_change():
    class Settles:
        def __init__(self) -> None:
            self.mode = "idle"
            self.sizes = (1, 2)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.mode = "busy"
            self.mode = "idle"
            self.sizes = (1, 2)  # a new tuple, equal to the old one
            return x * 2

    runner = gg.GraphRunner(Settles(), backend="sim", admission=EAGER_FIRST)
    for x in calls(3):
        runner(x)
    assert runner.stats()["replays"] == 3


def test_changes_are_put_back_and_forth_in_place():
    class Holder:
        __slots__ = ("slot",)

    class Thing:
        pass

    thing, holder = Thing(), Holder()
    thing.count, thing.items, thing.table = 1, [1, 2], {"a": 1}
    holder.slot = "x"
    roots = [thing, holder]
    items, table = thing.items, thing.table
    before = PyState.of(roots)
    thing.count = 2
    thing.items.append(3)
    thing.table["b"] = 2
    thing.added = True
    holder.slot = "y"
    changes = before.changes(PyState.of(roots))
    assert len(changes) == 5
    changes.undo()
    assert (thing.count, thing.items, thing.table, holder.slot) == (1, [1, 2], {"a": 1}, "x")
    assert not hasattr(thing, "added")
    assert thing.items is items and thing.table is table  # the same objects, emptied back
    changes.redo()
    assert (thing.count, thing.items, holder.slot) == (2, [1, 2, 3], "y")
    assert thing.table == {"a": 1, "b": 2}
    assert thing.added is True


def test_an_object_no_longer_reached_is_not_emptied_by_undo():
    class Node:
        def __init__(self, value: int) -> None:
            self.value = value

    class Graph:
        def __init__(self) -> None:
            self.nodes = [Node(1), Node(2)]

    graph = Graph()
    dropped = graph.nodes[1]
    before = PyState.of([graph])
    graph.nodes.pop()
    changes = before.changes(PyState.of([graph]))
    assert len(changes) == 1  # the list's contents; the dropped node itself is unchanged
    changes.redo()
    assert dropped.value == 2


def test_an_opaque_kernels_own_state_is_not_found():
    # NOTE: what a kernel keeps in native code (here: behind a custom op) is not Python-side
    # state; the stand-in kernel runs again at every replay
    step = kernel(lambda x: x * 3)
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    for x in calls(3):
        assert torch.equal(runner(x), x * 3)
    assert runner.stats()["replays"] == 3


def test_a_cache_grown_by_concatenation_is_refused():
    class Growing:
        def __init__(self) -> None:
            self.keys = torch.zeros(0, 4)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.keys = torch.cat([self.keys, x])  # a tensor made by the step, kept
            return self.keys.sum(0)

    graphed, twin = Growing(), Growing()
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    for x in calls(3):
        assert torch.equal(runner(x), twin(x))
    assert runner.stats()["fallbacks"] == {"python_state": 3}
    assert torch.equal(graphed.keys, twin.keys)


def test_a_temporary_left_in_a_reference_cycle_is_not_kept_state():
    def step(x: torch.Tensor) -> torch.Tensor:
        scratch: dict = {"t": x * 3}
        scratch["self"] = scratch  # garbage, alive until the collector runs
        return scratch["t"] + 1

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    for x in calls(2):
        assert torch.equal(runner(x), x * 3 + 1)
    assert runner.stats()["replays"] == 2


def test_an_unwatched_object_a_holed_step_changes_does_not_refuse_it():
    from graphguard.core.holes import hole

    class Stats:
        def __init__(self) -> None:
            self.calls = 0

    stats, table = Stats(), torch.zeros(1, 4)

    def bump(x: torch.Tensor) -> torch.Tensor:
        return table.add_(x)

    def step(x: torch.Tensor) -> torch.Tensor:
        stats.calls += 1  # not the step's state: declared unwatched
        return hole(bump, x) * 2

    capture = gg.CaptureConfig(unwatched=[stats])
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, capture=capture)
    for x in calls(3):
        runner(x)
    assert runner.stats()["replays"] == 3


def test_a_holed_step_whose_replay_changes_nothing_eager_changed_says_so(caplog):
    from graphguard.core.holes import hole

    class Outside:
        def __init__(self) -> None:
            self.n = 0

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.n += 1  # outside the hole: a replay leaves it as it was
            return hole(torch.neg, x)

    runner = gg.GraphRunner(Outside(), backend="sim", admission=EAGER_FIRST)
    runner(torch.ones(2))
    assert runner.stats()["fallbacks"] == {"python_state": 1}
    assert "a replay leaves the Python-side values as they were" in caplog.text


def test_the_record_run_logs_which_results_of_a_hole_it_made():
    from graphguard.core.holes import hole
    from graphguard.core.state import StateOptions, watch_step

    table = torch.zeros(2)

    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return table, x * 2  # one that existed before the step, one made in the hole

    def step(x: torch.Tensor) -> torch.Tensor:
        kept, made = hole(both, x + 1)
        return kept + made

    recorded = watch_step(step, [torch.ones(2)], torch.device("cpu"), StateOptions())
    (call,) = recorded.holes.calls
    assert call.made == [False, True] and call.results[0] is table


def test_undo_puts_back_a_dict_subclass_that_refuses_its_own_update():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class Holder:
        def __init__(self) -> None:
            self.out = CausalLMOutputWithPast(logits=torch.zeros(1))

    holder = Holder()
    before = PyState.of([holder])
    holder.out["loss"] = torch.ones(1)  # a ModelOutput takes item assignment, not update()
    changes = before.changes(PyState.of([holder]))
    changes.undo()
    assert list(holder.out.keys()) == ["logits"]
    changes.redo()
    assert list(holder.out.keys()) == ["logits", "loss"]


def test_a_dict_reordered_is_a_change_and_a_nan_rebound_is_not():
    from collections import OrderedDict

    class Holder:
        def __init__(self) -> None:
            self.table = OrderedDict(a=1, b=2)
            self.value = float("nan")

    holder = Holder()
    before = PyState.of([holder])
    holder.table.move_to_end("a")
    holder.value = float("nan")
    changes = before.changes(PyState.of([holder]))
    assert len(changes) == 1 and changes[0].owner is holder.table


def test_a_reverified_replay_whose_step_now_changes_python_state_runs_it_once():
    class Turns:
        def __init__(self) -> None:
            self.counting = False
            self.n = 0

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            if self.counting:
                self.n += 1
            return x * 2

    step = Turns()
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, verify=gg.VerifyConfig(
        reverify_every=1))  # fmt: skip
    runner(torch.ones(2))  # captured: no Python-side change yet
    step.counting = True  # the caller's change; the next re-verification sees the new path
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    assert step.n == 1 and runner.stats()["fallbacks"] == {"parity_mismatch": 1}


def test_a_tensor_the_step_keeps_where_the_python_walk_does_not_reach_is_refused():
    history = types.ModuleType("history")  # modules are never walked: only `kept` can see it
    history.sums = []

    def step(x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        history.sums.append(out.sum())  # made by the step, held by a Python list
        return out

    with pytest.raises(PythonState) as refused:
        watch_step(step, [torch.ones(2)], torch.device("cpu"), StateOptions())
    assert str(refused.value) == (
        "python_state: the step kept 1 tensors it created (state held in Python objects, such "
        "as a cache that grows by concatenation)"
    )
    assert torch.equal(refused.value.outputs, torch.full((2,), 2.0))  # the run answers the call


def test_what_an_unwatched_object_holds_is_never_walked(monkeypatch, caplog):
    monkeypatch.setattr(pystate, "MAX_OBJECTS", 20)
    entries = [types.SimpleNamespace(n=i) for i in range(30)]  # more objects than a walk takes

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * len(entries)

    PyState.of([step])
    assert "a step reaches over 20 objects" in caplog.text  # watched, the entries are walked
    caplog.clear()
    options = StateOptions(unwatched=(entries,))
    recorded = watch_step(step, [torch.ones(2)], torch.device("cpu"), options)
    assert recorded.python_differs([step], options.unwatched) is None
    assert "reaches over" not in caplog.text
