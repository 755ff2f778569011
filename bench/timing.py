"""Timing helpers shared by the benchmarks: per-call latencies with the device synchronized."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def graph_replay_ms(fn: Callable[..., Any], *inputs: Any, replays: int = 50) -> float:
    """Device time of `fn(*inputs)` captured as a raw CUDA graph (after one eager call): the
    median of `replays` replays, timed with events."""
    fn(*inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs)
    times = []
    for _ in range(replays):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        graph.replay()
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended))
    del graph
    return sorted(times)[len(times) // 2]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_ms(fn: Callable[[], Any], *, iters: int, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` of the mean wall time of `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    sync()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        means.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(means)


def latencies_ms(calls: list[Callable[[], Any]]) -> list[float]:
    """Wall time of each call, synchronized after each (what a request sees)."""
    out = []
    for call in calls:
        start = time.perf_counter()
        call()
        sync()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or os.environ.get("BENCH_OUT") or "bench-results")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, payload: dict[str, Any]) -> Path:
    payload = dict(payload, environment=environment())
    path = out_dir() / name
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    return env
