"""SimBackend: the CPU stand-in that lets CI exercise every lifecycle rule.

"Capture" runs the function under a dispatch mode that rejects the host-synchronizing ops a
real capture rejects, "replay" re-runs it into the same static output tensors (so aliasing and
overwrite-on-next-replay behave as on CUDA), and resident bytes are computed deterministically.
It keeps CudaBackend's contracts; it is not a performance path.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from graphguard.core.backends import CaptureError

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
    """An event as an identity: which stream it was last recorded on, and how often."""

    def __init__(self) -> None:
        self.num_records = 0
        self.stream: Any = None

    def record(self, stream: Any = None) -> None:
        self.num_records += 1
        self.stream = stream


class SimStream:
    """A stream as an identity, so tests can check which stream each operation used."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"SimStream({self.number})"


CALLER_STREAM = SimStream(0)


class SimBackend:
    """CPU stand-in with the CUDA backend's contracts (see module docstring).

    It keeps what CudaBackend keeps: a pool per capture charged in whole segments (static inputs,
    the capture's peak of live bytes and, once per pool, a `workspace_bytes` block standing for
    the cuBLAS workspace that a CUDA capture binds inside its pool); `num_warmup` warm-up runs
    before each capture (none by default: they only cost time on a CPU); streams created and
    destroyed (a stream released twice is an error); events recorded on a named stream; replays
    on the caller's stream (`current`, which tests may switch).
    """

    name = "sim"

    def __init__(
        self, segment_bytes: int = SIM_SEGMENT_BYTES, workspace_bytes: int = 0, num_warmup: int = 0
    ):
        self.device = torch.device("cpu")
        self.segment_bytes = segment_bytes
        self.workspace_bytes = workspace_bytes
        self.num_warmup = num_warmup  # CUDA warms up twice; the simulation needs none
        self.num_warmups = 0
        self._ids = itertools.count(1)
        self._pool_bytes: dict[int, int] = {}
        self._pool_live: dict[int, int] = {}  # bytes in use inside each pool
        self.num_captures = 0
        self.num_trims = 0
        self.live_streams: set[SimStream] = set()
        self.released_streams: set[SimStream] = set()
        self.waits: list[tuple[SimEvent, Any]] = []  # (event, the stream it was recorded on)
        self.current: Any = CALLER_STREAM

    def new_stream(self) -> SimStream:
        stream = SimStream(next(self._ids))
        self.live_streams.add(stream)
        return stream

    def release_stream(self, stream: Any) -> None:
        if stream not in self.live_streams:
            raise RuntimeError(f"{stream!r} released twice or never created")
        self.live_streams.remove(stream)
        self.released_streams.add(stream)

    def new_pool(self) -> tuple[int, int]:
        pool = (0, next(self._ids))
        self._pool_bytes[pool[1]] = 0
        self._pool_live[pool[1]] = 0
        return pool

    def release_pool(self, pool: Any) -> None:
        self._pool_bytes.pop(pool[1], None)
        self._pool_live.pop(pool[1], None)

    def new_event(self) -> SimEvent:
        return SimEvent()

    @contextmanager
    def allocating(self, pool: Any, stream: Any) -> Iterator[None]:
        if stream not in self.live_streams:
            raise RuntimeError(f"allocation on {stream!r}, which is not live")
        yield

    def warm_up(self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any) -> None:
        if stream not in self.live_streams:
            raise RuntimeError(f"warm-up on {stream!r}, which is not live")
        if pool is None or pool[1] not in self._pool_bytes:
            raise RuntimeError(f"warm-up outside a live pool: {pool!r}")
        try:
            with torch.no_grad():
                fn(*args)
        except Exception as exc:
            raise CaptureError(f"warm-up failed: {type(exc).__name__}: {exc}") from exc
        self.num_warmups += 1

    def capture(
        self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any
    ) -> tuple[Any, Any]:
        if stream not in self.live_streams:
            raise RuntimeError(f"capture on {stream!r}, which is not live")
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
        self._charge(pool[1], _tensor_bytes(args), mode.peak_bytes, _tensor_bytes(outputs))
        self.num_captures += 1
        return SimGraph(fn, args, outputs), outputs

    def _charge(self, pool: int, static_bytes: int, peak_bytes: int, output_bytes: int) -> None:
        """Grow the pool as the CUDA allocator would: static inputs and outputs stay live, the
        capture's peak reuses free blocks, one workspace per pool, whole segments."""
        workspace = self.workspace_bytes if self._pool_bytes.get(pool, 0) == 0 else 0
        live = self._pool_live.get(pool, 0) + static_bytes + workspace
        needed = -(-(live + peak_bytes) // self.segment_bytes) * self.segment_bytes
        self._pool_live[pool] = live + output_bytes
        self._pool_bytes[pool] = max(self._pool_bytes.get(pool, 0), needed, self.segment_bytes)

    def current_stream(self) -> Any:
        return self.current

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, event: Any) -> None:
        self.waits.append((event, event.stream))  # CPU work is synchronous: nothing to wait on

    def reset(self, graph: Any) -> None:
        graph.reset()

    def pool_reserved_bytes(self, pool: Any) -> int:
        return self._pool_bytes.get(pool[1], 0)

    def reserved_bytes(self) -> int:
        """What memory_reserved() would show of the graphs: every live pool's segments."""
        return sum(self._pool_bytes.values())

    def trim(self) -> None:
        self.num_trims += 1

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


def _tensor_bytes(values: Any) -> int:
    tensors = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in tensors)
