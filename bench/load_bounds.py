"""Which side bounds a serve_load run: the clients, the server's HTTP process, or the engine.

Each client process reports its CPU seconds against its wall seconds (near 1: it was busy all
the time, so the load it offered was its own limit). The server's process and its children
(the engine process, tensor-parallel ranks) are read through psutil, or /proc where psutil is
missing. The engine's steps and tokens over the load come from /metrics, so its step interval
can be set against the gap between a stream's tokens as the clients received them: a gap near
the step interval means the server hands tokens out as fast as the engine makes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

try:
    import psutil
except ImportError:  # /proc below
    psutil = None

BUSY = 0.85  # a process busy this fraction of the wall (of one core) is taken as the bound
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ClientRun:
    """One client process's share of the load."""

    results: list[Any]  # serve_load.RequestResult
    cpu_s: float
    wall_s: float


def listener_pid(port: int) -> int | None:
    """The process listening on loopback `port` (None when it cannot be found): with
    `--api-server-count`, the first API server, whose children the others are."""
    if psutil is None:
        return None
    try:
        pids = {c.pid for c in psutil.net_connections(kind="tcp") if _listens_on(c, port)}
    except psutil.AccessDenied:
        return None
    for pid in pids:
        if not {parent.pid for parent in psutil.Process(pid).parents()} & pids:
            return pid
    return None


def _listens_on(connection: Any, port: int | None) -> bool:
    address = connection.laddr
    return bool(address) and address.port == port and connection.status == "LISTEN"


def cpu_seconds(pid: int | None, port: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of `pid` ("server"), of each of its children that listen on
    `port` too ("server_1", ...: the other API server processes), and of the other descendants
    together ("engine")."""
    if pid is None:
        return {}
    if psutil is None:
        return {"server": _proc_cpu_s(pid)}
    process = psutil.Process(pid)
    figures = {"server": _psutil_cpu_s(process), "engine": 0.0}
    for child in process.children(recursive=True):
        try:
            listens = any(_listens_on(c, port) for c in child.net_connections(kind="tcp"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            listens = False
        if listens:
            figures[f"server_{sum(name.startswith('server') for name in figures)}"] = _psutil_cpu_s(
                child
            )
        else:
            figures["engine"] += _psutil_cpu_s(child)
    return figures


def _psutil_cpu_s(process: Any) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(times.user + times.system)


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def engine_counts(url: str) -> dict[str, float]:
    """Engine steps and generated tokens so far, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = {"graphguard_server_engine_steps": "steps"}
    names["graphguard_server_generation_tokens_total"] = "tokens"
    counts = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            counts[names[name]] = float(value)
    return counts


def bound_report(
    runs: list[ClientRun],
    wall_s: float,
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
    counts_before: dict[str, float],
    counts_after: dict[str, float],
    tpot_p50_s: float | None,
) -> dict[str, Any]:
    """The figures that say which side bounds the run, and that side ("bound")."""
    client_busy = max(run.cpu_s / run.wall_s for run in runs)
    busy = {name: (cpu_after[name] - cpu_before.get(name, 0.0)) / wall_s for name in cpu_after}
    servers = [busy.pop(name) for name in list(busy) if name.startswith("server")]
    if servers:
        busy["server"] = max(servers)  # the busiest API server process
    steps = counts_after.get("steps", 0.0) - counts_before.get("steps", 0.0)
    report: dict[str, Any] = {
        "num_clients": len(runs),
        "client_cpu_s": [round(run.cpu_s, 3) for run in runs],
        "client_busy_max": round(client_busy, 3),
        "server_busy": round(busy.get("server", float("nan")), 3),
        "server_busy_each": [round(figure, 3) for figure in servers],
        "engine_busy": round(busy.get("engine", float("nan")), 3),
        "engine_steps": int(steps),
        "engine_step_interval_ms": round(wall_s / steps * 1e3, 3) if steps else None,
        "token_gap_p50_ms": round(tpot_p50_s * 1e3, 3) if tpot_p50_s else None,
    }
    # What a streamed token costs each side in CPU (the server's includes its share of the
    # requests' own work): the figure to compare between versions of the server.
    num_tokens = sum(result.num_output_tokens for run in runs for result in run.results)
    if num_tokens:
        per_token_us = 1e6 / num_tokens
        client_cpu_s = sum(run.cpu_s for run in runs)
        report["client_cpu_us_per_token"] = round(client_cpu_s * per_token_us, 1)
        if servers:  # all the API server processes together
            report["server_cpu_us_per_token"] = round(sum(servers) * wall_s * per_token_us, 1)
    report["bound"] = _verdict(client_busy, busy)
    return report


def _verdict(client_busy: float, busy: dict[str, float]) -> str:
    if client_busy >= BUSY:
        return "client"
    if busy.get("server", 0.0) >= BUSY:
        return "server"
    if busy.get("engine", 0.0) >= BUSY or "engine" not in busy:
        return "engine"  # in-process mode: the server's process is the engine's too
    return "neither (idle time: a lock, the network, or too few streams)"
