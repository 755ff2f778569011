"""Backends: how a graph is captured, replayed and measured.

CudaBackend drives torch.cuda.CUDAGraph; SimBackend (sim.py) is the CPU stand-in with the same
contracts. Both satisfy the Backend protocol below.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

log = logging.getLogger("graphguard")
Work = Callable[[], None]


class CaptureError(RuntimeError):
    """Capture of a graph failed; the stream is no longer capturing."""


class Backend(Protocol):
    """What GraphEntry and GraphRunner need from a graph implementation."""

    name: str
    device: torch.device

    def new_stream(self) -> Any: ...
    def release_stream(self, stream: Any) -> None: ...
    def release_pool(self, pool: Any) -> None: ...
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
                "graphguard: CUBLAS_WORKSPACE_CONFIG is neither ':4096:8' nor ':16:8'; with "
                "several streams active cuBLAS may choose other kernels than eager, and exact "
                "parity checks can then reject good graphs. Set it before CUDA starts."
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
        # NOTE: called after the entry waited on its last replay and reset its graph; a stream
        # released twice must not be handed to two entries.
        if getattr(stream, "owned_handle", None) is not None and stream not in self._free_streams:
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
            try:
                for _ in range(self.num_warmup):  # warm-up on the entry's own stream
                    fn(*args)
                stream.synchronize()
            except Exception as exc:
                raise CaptureError(f"warm-up failed: {type(exc).__name__}: {exc}") from exc
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            # NOTE: capture_begin/capture_end directly rather than torch.cuda.graph(), whose
            # __enter__ synchronizes the whole device and empties the allocator cache.
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = fn(*args)
            except BaseException as exc:
                self._end_failed_capture(graph, pool, stream)
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt and friends stay what they are, after cleanup
                raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
            try:
                graph.capture_end()
            except RuntimeError as exc:
                self._repair_after_failed_end(graph, pool, stream)
                raise CaptureError(str(exc)) from exc
            try:
                graph.instantiate()
            except RuntimeError as exc:
                graph.reset()
                raise CaptureError(str(exc)) from exc
        caller.wait_stream(stream)
        return graph, outputs

    def _end_failed_capture(self, graph: Any, pool: Any, stream: Any) -> None:
        """End a capture whose function raised: no stream is left capturing."""
        try:
            graph.capture_end()
        except RuntimeError:
            self._repair_after_failed_end(graph, pool, stream)
            return
        graph.reset()

    def _repair_after_failed_end(self, graph: Any, pool: Any, stream: Any) -> None:
        """Undo what a raising CUDAGraph.capture_end left behind.

        It raises (the capture was invalidated) before it stops routing the stream's
        allocations into the pool and before the default generator leaves capture mode; the
        allocator is pointed back here, and a small capture that completes runs the
        generator's epilogue.
        """
        index = self.device.index
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

    def release_pool(self, pool: Any) -> None:
        return None  # the pool's segments go back on the next trim, once its graph is reset

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
