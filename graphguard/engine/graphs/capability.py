"""Whether the engine's graphs may run: the capability proof (deny by default: the first
failing condition is reported from a closed set), and the engine's CUDA backend."""

from __future__ import annotations

import enum

import torch

from graphguard.core.backends import Backend, CudaBackend
from graphguard.core.switch import kill_switch_on
from graphguard.engine.config import GraphConfig
from graphguard.engine.models.forward import EagerForward

MIN_COMPUTE_CAPABILITY = (7, 0)


class GraphCapability(enum.StrEnum):
    """Whether the engine's graphs may run, and if not, the first condition that failed."""

    ENABLED = "enabled"
    ENFORCE_EAGER = "enforce_eager"
    KILL_SWITCH = "kill_switch"
    NO_CUDA = "no_cuda"
    UNSUPPORTED_ARCH = "unsupported_arch"
    KV_IDENTITY_MISMATCH = "kv_identity_mismatch"
    DEVICE_MISMATCH = "device_mismatch"


def check_capability(
    config: GraphConfig, forward: EagerForward, scheduler_kv: object, device: torch.device
) -> GraphCapability:
    """The capability proof: every condition, in order; the first that fails is returned."""
    if config.enforce_eager:
        return GraphCapability.ENFORCE_EAGER
    if kill_switch_on():
        return GraphCapability.KILL_SWITCH
    if config.backend != "sim":
        if device.type != "cuda" or not torch.cuda.is_available():
            return GraphCapability.NO_CUDA
        if torch.cuda.get_device_capability(device) < MIN_COMPUTE_CAPABILITY:
            return GraphCapability.UNSUPPORTED_ARCH
    # The KV view the scheduler allocates from and the one attention writes must be one object.
    if forward.kv is not scheduler_kv:
        return GraphCapability.KV_IDENTITY_MISMATCH
    kv = forward.kv
    tensors = [*kv.k_cache, *kv.v_cache, *forward.model.parameters()]
    if any(t.device != device for t in tensors):
        return GraphCapability.DEVICE_MISMATCH
    return GraphCapability.ENABLED


def engine_backend(config: GraphConfig, device: torch.device) -> str | Backend:
    """A CUDA backend of the engine's own, warming up `config.capture_warmups` times before a
    capture; "sim" (and "auto" without CUDA) as named."""
    if config.backend == "sim" or (config.backend == "auto" and not torch.cuda.is_available()):
        return config.backend
    return CudaBackend(device, num_warmup=config.capture_warmups)
