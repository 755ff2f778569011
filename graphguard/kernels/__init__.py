"""The kernels a decoder runs, chosen once when an engine starts.

``torch``: plain PyTorch ops, the CPU path and the reference. ``triton``: fused Triton kernels
(graphguard/kernels/fused.py) for CUDA. ``q4``: 4-bit GEMMs on the CPU for weights stored in
4-bit blocks, a rescored 8-bit head and fused Numba loops for the rest, float32 activations
(graphguard/kernels/q4.py); asked for only.
``auto`` picks triton on a CUDA device in half precision when Triton imports, else torch, and
says why.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
from dataclasses import dataclass

import torch

from graphguard.kernels.isa import cpu_features
from graphguard.kernels.reference import HeadShape, QKNorm, TorchKernels


class KernelChoice(enum.Enum):
    """What `--kernels` asks for."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    Q4 = "q4"


@dataclass(frozen=True)
class KernelSelection:
    """The kernel set an engine runs, why, and on a CPU the instruction sets its ops use
    (graphguard/kernels/isa.py); shown in the startup log and /v1/graphs."""

    kernels: TorchKernels
    reason: str
    cpu_features: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.kernels.name

    def describe(self) -> str:
        """The set, why, and what runs beside it: a CPU's instruction sets, the switches the
        environment changed from their defaults (`TorchKernels.opt_ins`)."""
        extras = (*self.cpu_features, *self.kernels.opt_ins())
        features = f"; {', '.join(extras)}" if extras else ""
        return f"{self.name} ({self.reason}{features})"


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton set cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"device is {device.type}, Triton kernels need CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def kernel_set_class(choice: KernelChoice | str) -> type[TorchKernels]:
    """The class of the set `choice` names, for what it asks of the engine before the model
    is loaded (its load and run dtypes); ``auto`` and ``triton`` ask nothing of it."""
    if KernelChoice(choice) is KernelChoice.Q4:
        from graphguard.kernels.q4 import Q4Kernels

        return Q4Kernels
    return TorchKernels


def select_kernels(
    choice: KernelChoice | str, device: torch.device, dtype: torch.dtype
) -> KernelSelection:
    """The kernel set for `choice` on `device`; an explicit ``triton`` that cannot run raises."""
    selection = _select(KernelChoice(choice), device, dtype)
    if device.type != "cpu":
        return selection
    return dataclasses.replace(selection, cpu_features=cpu_features())


def _select(choice: KernelChoice, device: torch.device, dtype: torch.dtype) -> KernelSelection:
    if choice is KernelChoice.Q4:
        if device.type != "cpu" or dtype is not torch.float32:
            raise ValueError(
                f"--kernels q4 runs on a CPU in float32 (4-bit weights, float32 activations), "
                f"not on {device.type} in {dtype}"
            )
        from graphguard.kernels.q4 import Q4Kernels

        return KernelSelection(Q4Kernels(), "asked for")
    if choice is KernelChoice.TORCH:
        return KernelSelection(TorchKernels(), "asked for")
    missing = triton_missing(device)
    if choice is KernelChoice.TRITON:
        if missing is not None:
            raise ValueError(f"--kernels triton cannot run: {missing}")
        return KernelSelection(_triton_kernels(), "asked for")
    if missing is not None:
        return KernelSelection(TorchKernels(), missing)
    if dtype not in (torch.bfloat16, torch.float16):
        return KernelSelection(TorchKernels(), f"{dtype} runs the reference ops")
    return KernelSelection(_triton_kernels(), "CUDA device, Triton available")


def _triton_kernels() -> TorchKernels:
    from graphguard.kernels.fused import TritonKernels  # imports triton

    return TritonKernels()


__all__ = [
    "HeadShape",
    "KernelChoice",
    "KernelSelection",
    "QKNorm",
    "TorchKernels",
    "select_kernels",
    "triton_missing",
]
