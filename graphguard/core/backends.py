"""Backends: how a graph is captured, replayed and measured.

CudaBackend drives torch.cuda.CUDAGraph. SimBackend is the CPU stand-in that lets CI exercise
every lifecycle rule: "capture" runs the function under a dispatch mode that rejects the
host-synchronizing ops a real capture rejects, "replay" re-runs it into the same static output
tensors (so aliasing and overwrite-on-next-replay behave as on CUDA), and resident bytes are
computed deterministically. SimBackend is not a performance path.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger("graphguard")
Work = Callable[[], None]
# Segments of a CUDA private pool come in 2 MiB steps for small allocations; the simulation
# rounds the same way, so a 1 MiB budget admits nothing on either backend.
SIM_SEGMENT_BYTES = 2 << 20


class CaptureError(RuntimeError):
    """Capture of a graph failed; the stream is no longer capturing."""


class Backend(Protocol):
    """What GraphEntry and GraphRunner need from a graph implementation."""

    name: str
    device: torch.device

    def new_stream(self) -> Any: ...
    def release_stream(self, stream: Any) -> None: ...
    def new_pool(self) -> Any: ...
    def new_event(self) -> Any: ...
    def capture(
        self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any
    ) -> tuple[Any, Any]: ...
    def launch(self, stream: Any, event: Any, work: Work) -> None: ...
    def wait(self, event: Any) -> None: ...
    def reset(self, graph: Any) -> None: ...
    def pool_reserved_bytes(self, pool: Any) -> int: ...
    def trim(self) -> None: ...
    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...


class CudaBackend:
    """torch.cuda.CUDAGraph with a private pool and a capture stream per entry."""

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None, num_warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs CUDA, and torch.cuda.is_available() is False")
        self.device = _cuda_device(device)
        self._free_streams: list[torch.cuda.Stream] = []
        if _suspect_cublas_config():
            log.warning(
                "graphguard: CUBLAS_WORKSPACE_CONFIG is not ':4096:8'; with several streams "
                "active cuBLAS may choose other kernels than eager, and exact parity checks can "
                "then reject good graphs. Set it before CUDA starts."
            )
        self.num_warmup = num_warmup

    def new_stream(self) -> torch.cuda.Stream:
        """A CUDA stream owned by one entry at a time.

        torch.cuda.Stream() hands out one of 32 pooled streams per device, so 40 graphs would
        share streams; through cuda.bindings (when installed) each live entry gets its own.
        Released streams are kept for the next entry rather than destroyed: PyTorch keys a
        cuBLAS workspace by stream and bakes it into the graphs captured there, so recycling
        bounds those workspaces by the peak number of live graphs.
        """
        if self._free_streams:
            return self._free_streams.pop()
        return _owned_stream(self.device) or torch.cuda.Stream(device=self.device)

    def release_stream(self, stream: Any) -> None:
        # NOTE: called after the entry waited on its last replay and reset its graph.
        if getattr(stream, "owned_handle", None) is not None:
            self._free_streams.append(stream)

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def capture(
        self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any
    ) -> tuple[Any, Any]:
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for _ in range(self.num_warmup):  # warm-up on the entry's own stream
                fn(*args)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            # NOTE: capture_begin/capture_end directly rather than torch.cuda.graph(), whose
            # __enter__ synchronizes the whole device and empties the allocator cache.
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn(*args)
            except BaseException as exc:
                self._end_failed_capture(graph, pool, stream)
                raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
            try:
                graph.capture_end()
                graph.instantiate()
            except RuntimeError as exc:
                graph.reset()
                raise CaptureError(str(exc)) from exc
        caller.wait_stream(stream)
        return graph, outputs

    def _end_failed_capture(self, graph: Any, pool: Any, stream: Any) -> None:
        """Leave no stream capturing, no allocator routed to the dead pool, and the RNG usable.

        When the capture was invalidated, CUDAGraph.capture_end raises before it stops routing
        the stream's allocations into the pool and before the default generator leaves capture
        mode; both are undone here.
        """
        index = self.device.index
        try:
            graph.capture_end()
        except RuntimeError:
            torch._C._cuda_endAllocateToPool(index, pool)
            torch._C._cuda_releasePool(index, pool)
            self._reset_generator(stream)
        graph.reset()

    def _reset_generator(self, stream: Any) -> None:
        # A small capture that completes runs the generator's capture epilogue.
        repair = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            repair.capture_begin(
                pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local"
            )
            torch.ones(1, device=self.device).add_(1)
            repair.capture_end()
        repair.reset()

    def launch(self, stream: Any, event: Any, work: Work) -> None:
        # The replay waits on the caller's stream; the caller's stream then waits on the replay.
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            work()
            event.record(stream)
        caller.wait_event(event)

    def wait(self, event: Any) -> None:
        event.synchronize()  # a host wait on that event, never on the current stream

    def reset(self, graph: Any) -> None:
        graph.reset()

    def pool_reserved_bytes(self, pool: Any) -> int:
        wanted = tuple(pool)
        return sum(
            int(seg["total_size"])
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", ())) == wanted
        )

    def trim(self) -> None:
        torch.cuda.empty_cache()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()


def _cuda_device(device: torch.device | int | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if parsed.type != "cuda":
        raise ValueError(f"CudaBackend needs a CUDA device, got {parsed}")
    index = parsed.index if parsed.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)


def _owned_stream(device: torch.device) -> torch.cuda.Stream | None:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    with torch.cuda.device(device):
        err, handle = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
    if err != cudart.cudaError_t.cudaSuccess:
        return None
    stream = torch.cuda.ExternalStream(int(handle), device=device)
    stream.owned_handle = handle  # type: ignore[attr-defined]
    return stream


def _suspect_cublas_config() -> bool:
    """cuBLAS may pick other kernels while several streams are active unless its workspace
    configuration is pinned, which breaks bitwise parity between a graph and eager."""
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8")


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


def release_pool(backend: Any, pool: Any) -> None:
    """Drop the backend's record of a pool (CUDA frees its segments on the next trim)."""
    release = getattr(backend, "release_pool", None)
    if release is not None:
        release(pool)
