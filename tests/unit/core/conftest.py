from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphguard as gg
from graphguard.core.sim import SIM_SEGMENT_BYTES
from tests.runner_options import grouped

MiB = 1 << 20
SEG = SIM_SEGMENT_BYTES


class FakeClock:
    """A hand-driven clock for admission decisions."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def mlp_step(x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tanh(x * 1.5 + pos)
    return h.sum(-1), h


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


@pytest.fixture
def make_runner(clock: FakeClock) -> Callable[..., gg.GraphRunner]:
    made: list[gg.GraphRunner] = []

    def make(fn: Callable[..., Any] = mlp_step, **kwargs: Any) -> gg.GraphRunner:
        kwargs.setdefault("backend", "sim")
        kwargs.setdefault("admission", gg.AdmissionConfig(min_hits=1))
        kwargs.setdefault("clock", clock)
        runner = gg.GraphRunner(fn, **grouped(kwargs))
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.close()


def inputs(rows: int, width: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


class PerfCounter:
    """Stands in for the `time` module of graphguard.core.entry: every perf_counter() reading
    comes `step_s` after the last, so each capture takes exactly `step_s`."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.step_s
        return self.now
