"""Which launches are programmatic dependents (graphguard/kernels/launch.py): Hopper and later
on CUDA, unless GRAPHGUARD_PDL=0; never on a CPU or in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from graphguard.kernels import launch


@pytest.fixture
def gpu_of(monkeypatch: pytest.MonkeyPatch):
    """A CUDA device of the given compute capability, outside the interpreter."""

    def make(major: int) -> torch.device:
        monkeypatch.setattr(launch, "_BY_DEVICE", {})
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (major, 0))
        return torch.device("cuda", 0)

    return make


def test_hopper_and_later_launch_as_dependents_and_older_gpus_do_not(gpu_of):
    assert launch.dependent_launch(gpu_of(9))
    assert launch.dependent_launch(gpu_of(10))
    assert not launch.dependent_launch(gpu_of(8))


def test_the_environment_turns_dependent_launch_off(gpu_of, monkeypatch):
    monkeypatch.setenv(launch.PDL_ENV, "0")
    assert not launch.dependent_launch(gpu_of(9))


def test_a_cpu_and_the_interpreter_never_launch_as_dependents(gpu_of, monkeypatch):
    assert not launch.dependent_launch(torch.device("cpu"))
    device = gpu_of(9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.dependent_launch(device)
