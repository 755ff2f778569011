"""Stand-ins for kernels: work a graph replays that graphguard cannot look into.

`kernel(effect)` is a custom op whose `effect(x)` runs at every execution of a step: its eager
runs, the capture (the CPU stand-in's capture runs the step once) and every replay, since the
recording backend records the op and runs it again as a CUDA graph replays a kernel. What an
effect keeps (offsets it cycles through, a clock it advances, rows it logs) lives behind the
op, where a capture's walk of the step's Python-side state does not look, as a kernel's own
state lives in native code. Tests use them for a kernel that is not deterministic, one that
takes time, or one that reports what it ran on.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

_EFFECTS: dict[int, Callable[[torch.Tensor], Any]] = {}


@torch.library.custom_op("graphguard_tests::kernel", mutates_args=())
def _kernel(x: torch.Tensor, key: int) -> torch.Tensor:
    out = _EFFECTS[key](x)
    return x.clone() if out is None else out


def kernel(effect: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A kernel of `effect`: `effect(x)` is its output (None: `x` unchanged)."""
    key = len(_EFFECTS)
    _EFFECTS[key] = effect

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.graphguard_tests.kernel(x, key)

    return run


def jitter(offsets: list[float], scale: float = 2.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """A kernel whose executions differ a little (a non-deterministic one): execution k gives
    x * scale + offsets[k % len(offsets)]."""
    cycle = itertools.cycle(offsets)
    return kernel(lambda x: x * scale + next(cycle))


def counting() -> Callable[[torch.Tensor], torch.Tensor]:
    """A kernel that drifts: execution k gives x + k (from 1)."""
    count = itertools.count(1)
    return kernel(lambda x: x + next(count))
