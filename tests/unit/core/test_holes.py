"""Eager holes in a captured step (graphguard/core/holes.py): a replay replays the graphs around
a hole and makes its call between them, so its tensor writes and Python-side changes happen at
every replay as in eager; what a replay could not keep right is refused."""

from __future__ import annotations

import itertools

import pytest
import torch

import graphguard as gg
import graphguard.core.single_graphs as single_graphs
from graphguard.core.holes import HoleMismatch, hole
from graphguard.core.verify import ParityError

EAGER_FIRST = gg.AdmissionConfig(min_hits=1)


class Table:
    """A step whose middle is a hole: it writes a row of a table at a Python counter, which
    it advances (as transformers' sliding-window cache layers keep an int)."""

    def __init__(self) -> None:
        self.n = 0
        self.table = torch.zeros(8, 4)

    def write(self, row: torch.Tensor) -> torch.Tensor:
        self.table[self.n % 8] = row
        self.n += 1
        return self.table  # the same tensor every call: the graph after the hole reads it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        row = torch.tanh(x * 2)
        table = hole(self.write, row)
        return table.sum(0) * self.table[0] + row


def calls(count: int) -> list[torch.Tensor]:
    return [torch.full((4,), 0.1 * (i + 1)) for i in range(count)]


def run(step, count: int = 6, **options) -> tuple[gg.GraphRunner, list[torch.Tensor]]:
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, **options)
    return runner, [runner(x) for x in calls(count)]


def test_a_hole_runs_at_every_replay_with_the_values_of_eager():
    graphed, twin = Table(), Table()
    runner, got = run(graphed)
    expected = [twin(x) for x in calls(6)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert graphed.n == twin.n == 6 and torch.equal(graphed.table, twin.table)
    stats = runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 6, {})
    (entry,) = runner.entries()
    assert entry.num_holes == 1


def test_a_tensor_the_hole_makes_is_copied_where_the_graph_after_it_reads():
    class Scaled:
        def __init__(self) -> None:
            self.scale = 1.0

        def scaled(self, row: torch.Tensor) -> torch.Tensor:
            self.scale += 1.0
            return row * self.scale  # a new tensor, of a host value read at each call

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return hole(self.scaled, x + 1) - 1

    graphed, twin = Scaled(), Scaled()
    runner, got = run(graphed)
    assert all(torch.equal(a, twin(x)) for a, x in zip(got, calls(6), strict=True))
    assert runner.stats()["replays"] == 6


def test_a_python_change_outside_the_holes_is_refused_after_the_first_replay():
    class Leaky(Table):
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1  # outside the hole: a replay would not count it
            return super().__call__(x)

    graphed, twin = Leaky(), Leaky()
    runner, got = run(graphed)
    expected = [twin(x) for x in calls(6)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert (graphed.steps, graphed.n) == (twin.steps, twin.n) == (6, 6)
    assert torch.equal(graphed.table, twin.table)
    assert runner.stats()["fallbacks"] == {"python_state": 6}


def test_a_rejected_capture_leaves_the_holes_writes_and_count_of_one_eager_call(monkeypatch):
    monkeypatch.setattr(single_graphs, "parity_error", lambda *a: ParityError("forced"))
    graphed, twin = Table(), Table()
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    x = calls(1)[0]
    assert torch.equal(runner(x), twin(x))
    assert runner.stats()["parity_mismatches"] == 1
    assert graphed.n == twin.n == 1 and torch.equal(graphed.table, twin.table)


def test_a_first_replay_whose_hole_returns_another_tensor_fails_the_capture():
    tables = [torch.zeros(4), torch.ones(4)]
    executions = itertools.count()  # native state: not found by the walk, as a kernel's

    def pick(row: torch.Tensor) -> torch.Tensor:
        return tables[next(executions) % 2]  # record run, capture, first replay: 0, 1, 0

    def step(x: torch.Tensor) -> torch.Tensor:
        return hole(pick, x) + x

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    x = torch.full((4,), 2.0)
    assert torch.equal(runner(x), tables[1] + x)  # eager's answer: the fourth execution
    assert runner.stats()["capture_failures"] == 1


class Later(Table):
    """A table whose hole returns the table twice, then another tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.other = torch.zeros(8, 4)

    def write(self, row: torch.Tensor) -> torch.Tensor:
        super().write(row)
        return self.table if self.n <= 2 else self.other


def test_a_later_replay_whose_hole_returns_another_tensor_raises():
    runner = gg.GraphRunner(Later(), backend="sim", admission=EAGER_FIRST)
    runner(calls(1)[0])  # captured: the hole returned the table
    runner(calls(1)[0])  # replayed: the table again
    with pytest.raises(HoleMismatch, match="another tensor"):
        runner(calls(1)[0])


def test_outside_a_capture_a_hole_is_a_plain_call():
    assert hole(lambda a, b=0: a + b, 1, b=2) == 3


def test_a_failed_replay_retires_its_graph_and_the_key_runs_eagerly_after():
    runner = gg.GraphRunner(Later(), backend="sim", admission=EAGER_FIRST)
    for _ in range(2):
        runner(calls(1)[0])
    with pytest.raises(HoleMismatch):
        runner(calls(1)[0])
    stats = runner.stats()
    assert stats["entries"] == 0 and stats["quarantined_keys"] == 1
    evicted = runner.metrics.registry.get_sample_value(
        "graphguard_evictions_total", {"cause": "replay_failed"}
    )
    assert evicted == 1.0
    runner(calls(1)[0])  # quarantined: eager
    assert runner.stats()["fallbacks"] == {"quarantined": 1}


def test_a_hole_inside_a_hole_is_part_of_it():
    class Nested(Table):
        def outer(self, row: torch.Tensor) -> torch.Tensor:
            doubled = row * 2
            return hole(self.write, doubled)  # runs inside the outer hole, as Python

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            table = hole(self.outer, torch.tanh(x))
            return table.sum(0) + x

    graphed, twin = Nested(), Nested()
    runner, got = run(graphed)
    assert all(torch.equal(a, twin(x)) for a, x in zip(got, calls(6), strict=True))
    assert graphed.n == twin.n == 6 and runner.stats()["replays"] == 6


def test_a_hole_may_return_its_own_argument_or_a_view_of_it():
    class Returns:
        def __init__(self) -> None:
            self.calls = 0

        def bump(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.calls += 1
            return t.add_(1), t[:2]  # the argument itself, and a view of it

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            same, view = hole(self.bump, x * 3)
            return same * 2 + view.sum()

    graphed, twin = Returns(), Returns()
    runner, got = run(graphed)
    assert all(torch.equal(a, twin(x)) for a, x in zip(got, calls(6), strict=True))
    assert runner.stats()["replays"] == 6 and graphed.calls == twin.calls == 6


def test_a_hole_whose_value_that_is_no_tensor_changes_cannot_feed_the_graph_after_it():
    class Counts:
        def __init__(self) -> None:
            self.n = 0

        def count(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            self.n += 1
            return x, self.n  # the graph after it baked the capture's count

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            y, n = hole(self.count, x + 1)
            return y * n

    runner = gg.GraphRunner(Counts(), backend="sim", admission=EAGER_FIRST)
    runner(torch.ones(2))  # captured (each run from the count the call found: 1)
    with pytest.raises(HoleMismatch, match="returned 2 where the capture saw 1"):
        runner(torch.ones(2))


def test_a_capture_that_fails_after_the_record_run_leaves_the_state_of_one_eager_call():
    class Syncs(Table):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            out = super().__call__(x)
            return out * float(out.sum())  # a host sync: the capture fails, eager does not

    graphed, twin = Syncs(), Syncs()
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    x = calls(1)[0]
    assert torch.equal(runner(x), twin(x))
    assert runner.stats()["capture_failures"] == 1
    assert graphed.n == twin.n == 1 and torch.equal(graphed.table, twin.table)
