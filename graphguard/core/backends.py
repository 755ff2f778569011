"""Backends: how a graph is captured, replayed and measured.

CudaBackend drives torch.cuda.CUDAGraph; SimBackend (sim.py) is the CPU stand-in with the same
contracts. Both satisfy the Backend protocol below.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch

from graphguard.core.holes import HoleCall, SplitGraph, taking_holes

log = logging.getLogger("graphguard")


class CaptureError(RuntimeError):
    """Capture of a graph failed; the stream is no longer capturing."""


class Backend(Protocol):
    """What GraphEntry and GraphRunner need from a graph implementation."""

    name: str
    device: torch.device
    num_warmup: int  # warm-up runs before a capture (each one a unit of a sliced capture)

    def new_stream(self) -> Any: ...
    def release_stream(self, stream: Any) -> None: ...
    def new_pool(self) -> Any: ...
    def release_pool(self, pool: Any) -> None: ...
    def new_event(self) -> Any: ...
    def allocating(self, pool: Any, stream: Any) -> AbstractContextManager[None]: ...
    def warm_up(
        self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any
    ) -> None: ...
    def capture(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        *,
        pool: Any,
        stream: Any,
        holes: Sequence[HoleCall] = (),
    ) -> tuple[Any, Any]: ...
    def current_stream(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait(self, event: Any) -> None: ...
    def reset(self, graph: Any) -> None: ...
    def pool_reserved_bytes(self, pool: Any) -> int: ...
    def trim(self) -> None: ...
    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...


class CudaBackend:
    """torch.cuda.CUDAGraph with a private pool and a capture stream per entry.

    Every device byte an entry causes lands in its own pool: static inputs, the warm-ups' blocks
    and the cuBLAS / cuBLASLt workspace that its capture binds (docs/runtime.md, "What is
    charged"). So the pool's reserved segments are the whole charge, and resetting the graph and
    dropping the pool gives them back.
    """

    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None, num_warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs CUDA, and torch.cuda.is_available() is False")
        self.device = _cuda_device(device)
        if _suspect_cublas_config():
            log.warning(
                "graphguard: CUBLAS_WORKSPACE_CONFIG is neither ':4096:8' nor ':16:8'; with "
                "several streams active cuBLAS may choose other kernels than eager, and exact "
                "parity checks can then reject good graphs. Set it before CUDA starts."
            )
        self.num_warmup = num_warmup
        self._index = self.device.index
        self._held: set[Any] = set()  # pools whose entry still holds them (release_pool)
        self._lock = threading.Lock()

    def new_stream(self) -> torch.cuda.Stream:
        """A CUDA stream of the entry's own, destroyed when the entry retires.

        torch.cuda.Stream() hands out one of 32 pooled streams per device, so 40 graphs would
        share streams; through cuda.bindings (when installed) each live entry gets its own.
        """
        return _owned_stream(self.device) or torch.cuda.Stream(device=self.device)

    def release_stream(self, stream: Any) -> None:
        # NOTE: called after the entry waited on its last replay and reset its graph. Every
        # warm-up and the capture cleared the cuBLAS workspace bound to this stream before they
        # returned, so nothing is keyed by it, however far the capture got.
        handle = getattr(stream, "owned_handle", None)
        if handle is None:
            return
        stream.owned_handle = None  # a second release destroys nothing
        from cuda.bindings import runtime as cudart

        stream.synchronize()
        cudart.cudaStreamDestroy(handle)

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def release_pool(self, pool: Any) -> None:
        """Drop the entry's hold on its pool (its graph was reset already): the allocator
        frees the pool's segments on the next trim(), whoever still names the pool."""
        with self._lock:
            if pool not in self._held:
                return
            self._held.discard(pool)
        torch._C._cuda_releasePool(self._index, pool)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    @contextmanager
    def allocating(self, pool: Any, stream: Any) -> Iterator[None]:
        """Allocations of this thread go to `pool`, on `stream` (after the caller's work).

        The first use creates the pool with one hold, the entry's, which release_pool() drops;
        later uses take and drop a hold of their own.
        """
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            torch._C._cuda_beginAllocateCurrentThreadToPool(self._index, pool)
            try:
                yield
            finally:
                torch._C._cuda_endAllocateToPool(self._index, pool)
                with self._lock:
                    is_first = pool not in self._held
                    self._held.add(pool)
                if not is_first:
                    torch._C._cuda_releasePool(self._index, pool)

    def warm_up(self, fn: Callable[..., Any], args: list[Any], *, pool: Any, stream: Any) -> None:
        """One warm-up run of `fn` on the entry's stream, allocating in its pool; a capture
        comes after `num_warmup` of them (lazy initialisation done, blocks cached).

        NOTE: the warm-up's cuBLAS workspace, keyed by the entry's stream and allocated in its
        pool, is cleared before the warm-up returns. A warm-up is a unit of its own: a capture
        cancelled or rejected after it never reaches capture()'s clears, and a workspace left
        cached would keep 32 MiB of a released pool reserved (uncharged) until some later
        capture cleared it, keyed by a destroyed stream whose handle a new stream may reuse."""
        with self.allocating(pool, stream):
            try:
                fn(*args)
                stream.synchronize()
            except Exception as exc:
                raise CaptureError(f"warm-up failed: {type(exc).__name__}: {exc}") from exc
            finally:
                _clear_blas_workspaces()

    def capture(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        *,
        pool: Any,
        stream: Any,
        holes: Sequence[HoleCall] = (),
    ) -> tuple[Any, Any]:
        """Capture `fn(*args)` on `stream` into `pool` (the warm-ups ran before, warm_up), one
        graph, or one per stretch between the record run's `holes` (graphguard/core/holes.py)."""
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_stream(caller)
            # NOTE: the workspace bound to (handle, stream) was allocated by the warm-ups;
            # clearing it makes the capture allocate its own inside the pool, and clearing again
            # after it leaves no cached workspace pointing into the pool (docs/runtime.md).
            # PyTorch's workspace cache is process-wide and unlocked: no other thread may be
            # inside cuBLAS meanwhile (the engine captures on its step thread, between steps).
            _clear_blas_workspaces()
            try:
                graph, outputs = self._capture_on(fn, args, pool, stream, holes)
            finally:
                _clear_blas_workspaces()
        caller.wait_stream(stream)
        return graph, outputs

    def _capture_on(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        pool_id: Any,
        stream: Any,
        holes: Sequence[HoleCall],
    ) -> tuple[Any, Any]:
        split = _Split(pool_id, holes, lambda: self.allocating(pool_id, stream))
        # NOTE: capture_begin/capture_end directly rather than torch.cuda.graph(), whose
        # __enter__ synchronizes the whole device and empties the allocator cache.
        split.begin()
        try:
            with taking_holes(split if holes else None):
                outputs = fn(*args)
            if len(split.calls) != len(holes):
                raise CaptureError(
                    f"the capture made {len(split.calls)} hole calls, the record run {len(holes)}"
                )
        except BaseException as exc:
            if split.is_capturing:
                self._end_failed_capture(split.graphs.pop(), pool_id, stream)
            split.reset()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends stay what they are, after cleanup
            if isinstance(exc, CaptureError):
                raise
            raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
        try:
            split.end()
        except RuntimeError as exc:
            self._repair_after_failed_end(split.graphs.pop(), pool_id, stream)
            split.reset()
            raise CaptureError(str(exc)) from exc
        try:
            for graph in split.graphs:
                graph.instantiate()
        except RuntimeError as exc:
            split.reset()
            raise CaptureError(str(exc)) from exc
        if not holes:
            return split.graphs[0], outputs
        return SplitGraph(split.graphs, split.calls), outputs

    def _end_failed_capture(self, graph: Any, pool_id: Any, stream: Any) -> None:
        """End a capture whose function raised: no stream is left capturing."""
        try:
            graph.capture_end()
        except RuntimeError:
            self._repair_after_failed_end(graph, pool_id, stream)
            return
        graph.reset()

    def _repair_after_failed_end(self, graph: Any, pool_id: Any, stream: Any) -> None:
        """Undo what a raising CUDAGraph.capture_end left behind.

        It raises (the capture was invalidated) before it stops routing the stream's
        allocations into the pool and before the default generator leaves capture mode; the
        allocator is pointed back here, and a small capture that completes runs the
        generator's epilogue.
        """
        torch._C._cuda_endAllocateToPool(self._index, pool_id)
        torch._C._cuda_releasePool(self._index, pool_id)
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

    def current_stream(self) -> Any:
        # NOTE: the raw (id, device, type) triple, not a Stream object: building one costs
        # host time on every replay (docs/benchmarks.md, "Design notes"), and only a retire
        # needs it (record()).
        return torch._C._cuda_getCurrentStream(self._index)

    def record(self, event: Any, stream: Any) -> None:
        stream_id, device_index, device_type = stream
        event.record(
            torch.cuda.Stream(
                stream_id=stream_id, device_index=device_index, device_type=device_type
            )
        )

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


class _Split:
    """A capture split at the step's holes: the graph being captured ends where a hole is
    called, the call is kept, and the next graph begins in the same pool.

    NOTE: a capture runs nothing, so a hole is not called here: what it returns is what it
    returned in the record run (`holes`), the same tensor where it returned one that existed
    before the step, an empty one of the same shape where it made one (each replay copies its
    result in), the same value where it returned no tensor. Python code after a hole reads, at
    capture, the values from before it: a branch on a value the hole changes is baked as eager
    did not take it, which the first replay's check against the record run finds."""

    def __init__(
        self,
        pool_id: Any,
        holes: Sequence[HoleCall],
        allocating: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.pool_id = pool_id
        self.holes = holes
        self.allocating = allocating  # the results a hole makes live in the graphs' pool
        self.graphs: list[Any] = []
        self.calls: list[HoleCall] = []
        self.is_capturing = False  # whether the last graph is being captured

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        graph.capture_begin(pool=self.pool_id, capture_error_mode="thread_local")
        self.graphs.append(graph)
        self.is_capturing = True

    def end(self) -> None:
        self.is_capturing = False
        self.graphs[-1].capture_end()

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        index = len(self.calls)
        if index >= len(self.holes):
            raise CaptureError(f"the capture made more hole calls than the record run's {index}")
        logged = self.holes[index]
        if fn != logged.fn:
            raise CaptureError(f"hole {index} calls {fn!r}, the record run's {logged.fn!r}")
        self.end()
        with self.allocating():
            results = [
                torch.empty_like(r) if made else r
                for r, made in zip(logged.results, logged.made, strict=True)
            ]
        self.calls.append(HoleCall(fn, args, kwargs, results, logged.made, logged.spec))
        _clear_blas_workspaces()  # the next graph's workspace in its pool, as for the first
        self.begin()
        return self.calls[-1].returned()

    def reset(self) -> None:
        """Drop every graph whose capture ended (one still capturing is the caller's to end)."""
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()
        self.calls.clear()


def _clear_blas_workspaces() -> None:
    """Drop every cached cuBLAS / cuBLASLt workspace (PyTorch re-creates one on next use)."""
    torch._C._cuda_clearCublasWorkspaces()


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
