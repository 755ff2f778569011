"""SimBackend: the CPU stand-in that lets CI exercise every lifecycle rule.

"Capture" runs the function under a dispatch mode that rejects the host-synchronizing ops a
real capture rejects, "replay" re-runs it into the same static output tensors (so aliasing and
overwrite-on-next-replay behave as on CUDA), and resident bytes are computed deterministically.
It keeps CudaBackend's contracts; it is not a performance path.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from graphguard.core.backends import CaptureError, Work

# Segments of a CUDA private pool come in 2 MiB steps for small allocations; the simulation
# rounds the same way, so a 1 MiB budget admits nothing on either backend.
SIM_SEGMENT_BYTES = 2 << 20


# Ops that synchronize with the host, so a CUDA stream capture rejects them.
_HOST_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_dim",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::equal",
    "aten::is_nonzero",
    "aten::allclose",
}


class _RejectHostSync(TorchDispatchMode):
    """Rejects host syncs like a capturing CUDA stream, and tracks the peak of live bytes.

    A CUDA graph's private pool reuses blocks freed during capture, so its size follows the
    peak of memory alive at once, not the sum of every allocation; the simulation follows it
    the same way (storages that an op's output shares with its inputs are views, not new).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_SYNC_OPS or (name == "aten::repeat_interleave" and not kwargs):
            raise RuntimeError(
                f"operation not permitted when stream is capturing ({name} synchronizes with "
                "the host)"
            )
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(t) for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if _is_tensor(t) and _storage_ptr(t) not in inputs:
                self._track(t)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        ptr = _storage_ptr(tensor)
        if ptr in self.live:
            return
        nbytes = tensor.untyped_storage().nbytes()
        self.live[ptr] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(tensor, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.live_bytes -= self.live.pop(ptr, 0)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class SimGraph:
    """A simulated graph: replay re-runs the function and writes the static outputs in place."""

    def __init__(self, fn: Callable[..., Any], args: list[Any], outputs: Any):
        self.fn: Callable[..., Any] | None = fn
        self.args: list[Any] | None = args
        self.outputs = outputs

    def replay(self) -> None:
        if self.fn is None or self.args is None:
            raise RuntimeError("replay of a SimGraph after reset")
        with torch.no_grad():
            fresh = self.fn(*self.args)
        for static, new in zip(tree_flatten(self.outputs)[0], tree_flatten(fresh)[0], strict=True):
            static.copy_(new)

    def reset(self) -> None:
        self.fn = self.args = None
        self.outputs = None


class SimEvent:
    def __init__(self) -> None:
        self.num_records = 0

    def record(self) -> None:
        self.num_records += 1


class SimBackend:
    """CPU stand-in with the CUDA backend's contracts (see module docstring)."""

    name = "sim"

    def __init__(self, segment_bytes: int = SIM_SEGMENT_BYTES):
        self.device = torch.device("cpu")
        self.segment_bytes = segment_bytes
        self._ids = itertools.count(1)
        self._pool_bytes: dict[int, int] = {}
        self.num_captures = 0
        self.num_trims = 0
        self.released_streams: set[int] = set()

    def new_stream(self) -> int:
        return next(self._ids)

    def release_stream(self, stream: Any) -> None:
        self.released_streams.add(stream)

    def new_pool(self) -> tuple[int, int]:
        pool = (0, next(self._ids))
        self._pool_bytes[pool[1]] = 0
        return pool

    def new_event(self) -> SimEvent:
        return SimEvent()

    def capture(
        self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any
    ) -> tuple[Any, Any]:
        mode = _RejectHostSync()
        try:
            with torch.no_grad(), mode:
                outputs = fn(*args)
        except Exception as exc:
            raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
        # NOTE: a real capture computes nothing: poison the outputs so that only a replay fills
        # them, exactly as on CUDA.
        outputs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor):
                t.fill_(float("nan") if t.is_floating_point() else -1)
        segments = -(-mode.peak_bytes // self.segment_bytes)
        self._pool_bytes[pool[1]] = (
            self._pool_bytes.get(pool[1], 0) + max(1, segments) * self.segment_bytes
        )
        self.num_captures += 1
        return SimGraph(fn, args, outputs), outputs

    def launch(self, stream: Any, event: Any, work: Work) -> None:
        work()
        event.record()

    def wait(self, event: Any) -> None:
        return None  # CPU work is synchronous

    def reset(self, graph: Any) -> None:
        graph.reset()

    def pool_reserved_bytes(self, pool: Any) -> int:
        return self._pool_bytes.get(pool[1], 0)

    def release_pool(self, pool: Any) -> None:
        self._pool_bytes.pop(pool[1], None)

    def trim(self) -> None:
        self.num_trims += 1

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()
