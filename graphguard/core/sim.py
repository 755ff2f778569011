"""SimBackend: the CPU stand-in that lets CI exercise every lifecycle rule.

"Capture" runs the function under a dispatch mode that rejects the host-synchronizing ops a
real capture rejects and records the ops it runs; "replay" runs that recording again, not the
function's Python, as a CUDA graph replays its kernels, into the same static output tensors (so
aliasing and overwrite-on-next-replay behave as on CUDA): graphguard/core/recording.py. With
`replay="rerun"` a replay re-runs the function instead (for steps the dispatcher does not see
whole). Resident bytes are computed deterministically. It keeps CudaBackend's contracts; it is
not a performance path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from graphguard.core.backends import CaptureError
from graphguard.core.holes import HoleCall, taking_holes
from graphguard.core.recording import Recorder, RejectHostSync, RerunGraph

# Segments of a CUDA private pool come in 2 MiB steps for small allocations; the simulation
# rounds the same way, so a 1 MiB budget admits nothing on either backend.
SIM_SEGMENT_BYTES = 2 << 20


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
        self,
        segment_bytes: int = SIM_SEGMENT_BYTES,
        workspace_bytes: int = 0,
        num_warmup: int = 0,
        replay: str = "record",
    ):
        if replay not in ("record", "rerun"):
            raise ValueError(f"replay must be 'record' or 'rerun', got {replay!r}")
        self.replay = replay  # "record": the ops captured; "rerun": the step's Python again
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
        self,
        fn: Callable[..., Any],
        args: list[Any],
        *,
        pool: Any,
        stream: Any,
        holes: Sequence[HoleCall] = (),
    ) -> tuple[Any, Any]:
        """Run `fn` once, recorded (its holes run as they come) or kept to re-run (its holes
        re-run with it); `holes`, the record run's, are for a backend that cannot run them."""
        del holes
        if stream not in self.live_streams:
            raise RuntimeError(f"capture on {stream!r}, which is not live")
        recorder = Recorder() if self.replay == "record" else None
        mode = recorder or RejectHostSync()
        try:
            with torch.no_grad(), mode, taking_holes(recorder):
                outputs = fn(*args)
        except Exception as exc:
            raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
        graph = RerunGraph(fn, args) if recorder is None else recorder.graph(outputs)
        # NOTE: a real capture computes nothing: poison the outputs so that only a replay fills
        # them, exactly as on CUDA.
        outputs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, outputs)
        graph.static_outputs = [t for t in tree_flatten(outputs)[0] if _is_tensor(t)]
        for t in graph.static_outputs:
            t.fill_(float("nan") if t.is_floating_point() else -1)
        self._charge(pool[1], _tensor_bytes(args), mode.peak_bytes, _tensor_bytes(outputs))
        self.num_captures += 1
        return graph, outputs

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


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _tensor_bytes(values: Any) -> int:
    tensors = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in tensors)
