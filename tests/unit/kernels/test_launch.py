"""Which launches are programmatic dependents (graphguard/kernels/launch.py): Hopper and later
on CUDA unless GRAPHGUARD_PDL=0; never on a CPU or in Triton's interpreter."""

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
        monkeypatch.setenv(launch.PDL_ENV, "1")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (major, 0))
        return torch.device("cuda", 0)

    return make


def test_hopper_and_later_launch_as_dependents_and_older_gpus_do_not(gpu_of):
    assert launch.dependent_launch(gpu_of(9))
    assert launch.dependent_launch(gpu_of(10))
    assert not launch.dependent_launch(gpu_of(8))


@pytest.mark.parametrize("setting", [None, "1", "yes"])
def test_dependent_launch_is_on_by_default(gpu_of, monkeypatch, setting):
    device = gpu_of(9)
    if setting is None:
        monkeypatch.delenv(launch.PDL_ENV)
    else:
        monkeypatch.setenv(launch.PDL_ENV, setting)
    assert launch.dependent_launch(device)


def test_the_environment_turns_dependent_launch_off(gpu_of, monkeypatch):
    device = gpu_of(9)
    monkeypatch.setenv(launch.PDL_ENV, "0")
    assert not launch.dependent_launch(device)


def test_a_cpu_and_the_interpreter_never_launch_as_dependents(gpu_of, monkeypatch):
    assert not launch.dependent_launch(torch.device("cpu"))
    device = gpu_of(9)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.dependent_launch(device)


def test_the_startup_line_names_what_the_environment_changed(monkeypatch):
    pytest.importorskip("triton")
    from graphguard.kernels import KernelSelection
    from graphguard.kernels.fused import PROLOGUES_ENV, SPLIT_K_ENV, TritonKernels

    for name in (launch.PDL_ENV, PROLOGUES_ENV, SPLIT_K_ENV):
        monkeypatch.delenv(name, raising=False)
    assert KernelSelection(TritonKernels(), "asked for").describe() == "triton (asked for)"
    monkeypatch.setenv(launch.PDL_ENV, "0")
    monkeypatch.setenv(PROLOGUES_ENV, "1")
    described = KernelSelection(TritonKernels(), "asked for").describe()
    assert described == f"triton (asked for; {PROLOGUES_ENV}=1, {launch.PDL_ENV}=0)"


def test_a_rocm_device_never_launches_as_a_dependent(gpu_of, monkeypatch):
    device = gpu_of(9)  # an MI300 reports capability 9
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not launch.dependent_launch(device)
