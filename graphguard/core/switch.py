"""Whether graphs may run in this process at all: the kill switch, and the backend a runner
resolves to ("auto" is CUDA where present; without one every call falls back with no_cuda)."""

from __future__ import annotations

import os
from typing import Any

import torch

from graphguard.core.backends import Backend, CudaBackend
from graphguard.core.sim import SimBackend

KILL_SWITCH_ENV = "GRAPHGUARD_DISABLE"
_TRUTHY = {"1", "true", "yes", "on"}

__all__ = ["KILL_SWITCH_ENV", "kill_switch_on", "resolve_backend"]


def kill_switch_on() -> bool:
    """GRAPHGUARD_DISABLE=1 (read on every call) turns every graph off."""
    value = os.environ.get(KILL_SWITCH_ENV)
    return value is not None and value.strip().lower() in _TRUTHY


def resolve_backend(backend: str | Backend, device: Any = None) -> Backend | None:
    """ "auto" is CUDA when present and None (every call falls back with no_cuda) otherwise."""
    if not isinstance(backend, str):
        return backend
    if backend == "sim":
        return SimBackend()
    if backend == "cuda":
        return CudaBackend(device)
    if backend == "auto":
        return CudaBackend(device) if torch.cuda.is_available() else None
    raise ValueError(f"backend must be 'auto', 'cuda', 'sim' or a Backend, got {backend!r}")
