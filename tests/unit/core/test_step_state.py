"""A step's tensor state (graphguard/core/state.py): what the record run writes is saved before
each write and put back, last first, so that no capture attempt, admitted or rejected, leaves
the caller's tensors other than one eager call leaves them; a graph that writes elsewhere than
eager, or answers otherwise in any output, is rejected."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
import graphguard.core.single_graphs as single_graphs
from graphguard.core.verify import ParityError
from tests.unit.core.stand_ins import counting, kernel

EAGER_FIRST = gg.AdmissionConfig(min_hits=1)


@pytest.fixture
def rejecting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every capture fails its parity check: the call is answered eagerly after the capture
    work ran the step several times."""
    monkeypatch.setattr(single_graphs, "parity_error", lambda *a: ParityError("forced"))


class Twice:
    """A step that reads, modifies and writes one region twice."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.buffer.add_(x)
        self.buffer.mul_(2)
        return self.buffer * 1


class IndexCopy:
    """A read-modify-write of a few rows through index_copy_."""

    def __init__(self) -> None:
        self.rows = torch.ones(6, 3)
        self.index = torch.tensor([1, 4])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.index_copy_(0, self.index, self.rows.index_select(0, self.index) + x)
        return self.rows.sum(0)


class IndexPut:
    """A read-modify-write of a few rows through index_put_."""

    def __init__(self) -> None:
        self.rows = torch.ones(6, 3)
        self.index = torch.tensor([2, 5])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.index_put_((self.index,), self.rows[self.index] * 3 + x)
        return self.rows.sum(0)


class OutArgument:
    """A read-modify-write through an op's `out=` argument (passed by keyword, never by
    position)."""

    def __init__(self) -> None:
        self.buffer = torch.ones(4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.neg(self.buffer * 2 + x, out=self.buffer)
        return self.buffer * 1


class ForEach:
    """A read-modify-write of two rows by one op that writes a list of tensors."""

    def __init__(self) -> None:
        self.rows = torch.ones(2, 3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch._foreach_mul_([self.rows[0], self.rows[1]], 3.0)
        torch._foreach_add_([self.rows[0], self.rows[1]], [x, x])
        return self.rows.sum(0)


STEPS = {
    "twice": (Twice, (4,)),
    "index_copy": (IndexCopy, (2, 3)),
    "index_put": (IndexPut, (2, 3)),
    "out_argument": (OutArgument, (4,)),
    "foreach": (ForEach, (3,)),
}


def state_of(step) -> torch.Tensor:
    return getattr(step, "buffer", None) if hasattr(step, "buffer") else step.rows


@pytest.mark.parametrize("name", STEPS)
def test_a_rejected_capture_leaves_the_state_of_one_eager_call(name, rejecting):
    make, shape = STEPS[name]
    graphed, twin = make(), make()
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    for i in range(3):
        x = torch.full(shape, float(i + 1))
        assert torch.equal(runner(x), twin(x))
        assert torch.equal(state_of(graphed), state_of(twin))
    assert runner.stats()["parity_mismatches"] >= 1


@pytest.mark.parametrize("name", STEPS)
def test_an_admitted_capture_leaves_the_state_of_one_eager_call_and_replays(name):
    make, shape = STEPS[name]
    graphed, twin = make(), make()
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    for i in range(4):
        x = torch.full(shape, float(i + 1))
        assert torch.equal(runner(x), twin(x))
        assert torch.equal(state_of(graphed), state_of(twin))
    assert runner.stats()["replays"] == 4


def test_a_graph_that_writes_another_slot_than_eager_is_rejected():
    rows = torch.zeros(4, 2)
    slot = kernel(lambda i: i + next(executions) % 4)  # a slot that moves on each execution
    executions = iter(range(100))

    def step(x: torch.Tensor) -> torch.Tensor:
        rows.index_copy_(0, slot(torch.zeros(1, dtype=torch.long)), x)
        return x * 2  # the answer does not show the slot: only the state check can

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    assert torch.equal(runner(torch.ones(1, 2)), torch.full((1, 2), 2.0))
    stats = runner.stats()
    assert stats["parity_mismatches"] == 1 and stats["entries"] == 0


def test_a_graph_that_differs_in_its_second_output_only_is_rejected():
    drifts = counting()

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, drifts(x)

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    runner(torch.zeros(3))
    assert runner.stats()["parity_mismatches"] == 1


def test_a_declared_state_is_saved_and_put_back_like_a_found_one(rejecting):
    graphed, twin = Twice(), Twice()
    capture = gg.CaptureConfig(state=[graphed.buffer])
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST, capture=capture)
    x = torch.ones(4)
    assert torch.equal(runner(x), twin(x)) and torch.equal(graphed.buffer, twin.buffer)


def test_saving_more_than_max_state_bytes_is_refused_before_anything_is_written():
    step = Twice()
    capture = gg.CaptureConfig(max_state_bytes=8)  # the buffer is 16 bytes
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, capture=capture)
    assert torch.equal(runner(torch.ones(4)), torch.full((4,), 2.0))
    assert torch.equal(step.buffer, torch.full((4,), 2.0))  # one execution, the eager answer
    assert runner.stats()["fallbacks"] == {"state_too_large": 1}


class Accumulates:
    """index_put_ with accumulate, at repeated indices (each adds twice)."""

    def __init__(self) -> None:
        self.rows = torch.ones(6, 3)
        self.index = torch.tensor([1, 1, 4])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.index_put_((self.index,), x, accumulate=True)
        return self.rows.sum(0)


class Columns:
    """index_put_ through a slice and an index (`rows[:, index] = ...`: a None index)."""

    def __init__(self) -> None:
        self.rows = torch.ones(3, 6)
        self.index = torch.tensor([0, 5])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows[:, self.index] = self.rows[:, self.index] * 2 + x
        return self.rows.sum(1)


@pytest.mark.parametrize("make,shape", [(Accumulates, (3, 3)), (Columns, (3, 2))])
def test_index_put_of_any_form_is_put_back_after_a_rejected_capture(make, shape, rejecting):
    graphed, twin = make(), make()
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST)
    for i in range(2):
        x = torch.full(shape, float(i + 1))
        assert torch.equal(runner(x), twin(x)) and torch.equal(graphed.rows, twin.rows)
    assert runner.stats()["parity_mismatches"] == 1  # captured, then rejected: not failed


def test_an_indexed_write_saves_its_elements_not_the_whole_tensor():
    class Few:
        def __init__(self) -> None:
            self.rows = torch.zeros(1000, 4)  # 16,000 bytes
            self.index = torch.tensor([3, 7])

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            self.rows.index_put_((self.index,), x)
            return x * 2

    capture = gg.CaptureConfig(max_state_bytes=64)  # the two rows' 32 bytes fit
    runner = gg.GraphRunner(Few(), backend="sim", admission=EAGER_FIRST, capture=capture)
    runner(torch.ones(2, 4))
    assert runner.stats()["replays"] == 1


def test_state_of_exactly_max_state_bytes_is_saved():
    step = Twice()  # two writes of a 16-byte buffer: 32 bytes saved
    capture = gg.CaptureConfig(max_state_bytes=32)
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, capture=capture)
    runner(torch.ones(4))
    assert runner.stats()["replays"] == 1


def test_a_declared_state_that_covers_every_write_replays():
    graphed, twin = IndexCopy(), IndexCopy()
    capture = gg.CaptureConfig(state=[graphed.rows])
    runner = gg.GraphRunner(graphed, backend="sim", admission=EAGER_FIRST, capture=capture)
    for i in range(3):
        x = torch.full((2, 3), float(i))
        assert torch.equal(runner(x), twin(x))
    assert runner.stats()["replays"] == 3 and torch.equal(graphed.rows, twin.rows)


def test_a_graph_that_writes_a_whole_tensor_otherwise_than_eager_is_rejected():
    buffer = torch.zeros(4)
    drifts = counting()

    def step(x: torch.Tensor) -> torch.Tensor:
        buffer.copy_(drifts(x))  # a whole-tensor write whose values move on each execution
        return x * 2

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    runner(torch.zeros(4))
    assert runner.stats()["parity_mismatches"] == 1


def test_undo_puts_back_once_until_the_step_runs_again():
    from graphguard.core.state import StateOptions, watch_step

    buffer = torch.zeros(3)

    def step(x: torch.Tensor) -> torch.Tensor:
        return buffer.add_(x) * 1

    recorded = watch_step(step, [torch.ones(3)], torch.device("cpu"), StateOptions())
    state = recorded.state
    state.undo()
    assert torch.equal(buffer, torch.zeros(3))
    buffer.fill_(5.0)  # the caller's own write, after the capture put the state back
    state.undo()
    assert torch.equal(buffer, torch.full((3,), 5.0))
    state.written()
    state.undo()
    assert torch.equal(buffer, torch.zeros(3))


def test_a_write_to_a_tensor_of_another_device_is_refused_before_it_is_made(caplog):
    elsewhere = torch.zeros(4, device="meta")  # not the graphs' device, as a host tensor is

    def step(x: torch.Tensor) -> torch.Tensor:
        elsewhere.add_(1)
        return x * 2

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    assert torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    assert runner.stats()["fallbacks"] == {"unownable_state": 1}
    assert "writes a meta tensor" in caplog.text


def test_a_write_to_the_steps_own_input_is_refused_and_named(caplog):
    def step(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)

    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    x = torch.ones(2)
    runner(x)
    assert runner.stats()["fallbacks"] == {"unownable_state": 1}
    assert "why=unownable_state: writes its own inputs in place runner=" in caplog.text
    assert torch.equal(x, torch.full((2,), 2.0))


def test_the_refusals_of_declared_and_large_state_name_why(caplog):
    counter = IndexCopy()
    declared = gg.CaptureConfig(state=[torch.zeros(1)])
    gg.GraphRunner(counter, backend="sim", admission=EAGER_FIRST, capture=declared)(
        torch.ones(2, 3)
    )
    assert "writes a tensor outside the declared state" in caplog.text
    small = gg.CaptureConfig(max_state_bytes=4)
    gg.GraphRunner(IndexCopy(), backend="sim", admission=EAGER_FIRST, capture=small)(
        torch.ones(2, 3)
    )
    assert "saving what it writes takes over 4 bytes" in caplog.text


def test_the_record_runs_outputs_are_copies_that_undo_leaves_as_the_run_made_them():
    from graphguard.core.state import StateOptions, watch_step

    buffer = torch.zeros(3)

    def step(x: torch.Tensor) -> torch.Tensor:
        return buffer.add_(x)  # the state itself is the answer

    recorded = watch_step(step, [torch.ones(3)], torch.device("cpu"), StateOptions())
    recorded.state.undo()
    assert torch.equal(buffer, torch.zeros(3))
    assert torch.equal(recorded.outputs, torch.ones(3))


def test_the_record_runs_outputs_that_are_no_tensors_are_kept_as_they_are():
    from graphguard.core.state import StateOptions, watch_step

    def step(x: torch.Tensor) -> tuple[torch.Tensor, str, int]:
        return x * 2, "done", 3

    recorded = watch_step(step, [torch.ones(2)], torch.device("cpu"), StateOptions())
    doubled, label, count = recorded.outputs
    assert torch.equal(doubled, torch.full((2,), 2.0)) and (label, count) == ("done", 3)


def test_regions_are_copies_of_what_was_written_where_they_live_or_on_the_device_asked_for():
    from graphguard.core.state import StateOptions, watch_step

    buffer = torch.zeros(3)

    def step(x: torch.Tensor) -> torch.Tensor:
        return buffer.add_(x) * 1

    state = watch_step(step, [torch.ones(3)], torch.device("cpu"), StateOptions()).state
    (region,) = state.regions()
    region.fill_(9.0)
    assert torch.equal(buffer, torch.ones(3)) and region.device == buffer.device
    (moved,) = state.regions(torch.device("meta"))  # another device than the state's
    assert moved.device == torch.device("meta") and moved.shape == buffer.shape


def test_a_cuda_device_named_without_an_index_is_the_current_one_as_tensors_name_it(
    monkeypatch: pytest.MonkeyPatch,
):
    from graphguard.core.state import _indexed

    # NOTE: a tensor on the current device says `cuda:1`, never `cuda`: without the index, every
    # write of the step's state would look like a write to another device's tensor
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _indexed(torch.device("cuda")) == torch.device("cuda", 1)
    assert _indexed(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert _indexed(torch.device("cpu")) == torch.device("cpu")
