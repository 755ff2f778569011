"""Eager holes on CUDA (graphguard/core/holes.py): a step captured as graphs split at its holes
replays each graph and makes each hole's call between them, with eager's values and state."""

import pytest
import torch

import graphguard as gg
from graphguard.core.holes import SplitGraph, hole

pytestmark = pytest.mark.gpu
EAGER_FIRST = gg.AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)


class Table:
    """A step with a hole in its middle: the hole writes a row of a table at a Python counter,
    advances it, and returns the table; the graph after it reads the table."""

    def __init__(self, device: torch.device) -> None:
        self.n = 0
        self.table = torch.zeros(8, 64, device=device)
        self.w = torch.randn(
            64, 64, device=device, generator=torch.Generator(device).manual_seed(0)
        )

    def write(self, row: torch.Tensor) -> torch.Tensor:
        self.table[self.n % 8] = row[0]
        self.n += 1
        return self.table

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h * (self.n + 1)  # a new tensor from a host value read at each call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        row = torch.tanh(x @ self.w)
        table = hole(self.write, row)
        h = hole(self.scaled, (table @ self.w).sum(0, keepdim=True))
        return torch.relu(h @ self.w) + row


def test_a_step_with_holes_replays_split_graphs_with_eagers_values_and_state(device):
    graphed, twin = Table(device), Table(device)
    runner = gg.GraphRunner(graphed, admission=EAGER_FIRST)
    for i in range(12):
        x = torch.randn(1, 64, device=device, generator=torch.Generator(device).manual_seed(i))
        assert torch.equal(runner(x), twin(x))
    assert graphed.n == twin.n == 12 and torch.equal(graphed.table, twin.table)
    stats = runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 12, {})
    (entry,) = runner._cache.entries()
    assert isinstance(entry.graph, SplitGraph) and entry.graph.num_holes == 2
    assert len(entry.graph.graphs) == 3
    runner.close()


def test_a_failed_capture_of_a_step_with_holes_leaves_no_stream_capturing(device):
    class Syncs(Table):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            out = super().__call__(x)
            return out * float(out.sum())  # a host sync after the holes: capture fails

    step, twin = Syncs(device), Syncs(device)
    runner = gg.GraphRunner(step, admission=EAGER_FIRST)
    x = torch.ones(1, 64, device=device)
    assert torch.equal(runner(x), twin(x))
    assert not torch.cuda.is_current_stream_capturing()
    assert runner.stats()["capture_failures"] == 1 and step.n == twin.n == 1
    runner.close()
