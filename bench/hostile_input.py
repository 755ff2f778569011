"""What one hostile request costs everyone else: while greedy streams run, a client sends a
5 MB body (declared or chunked) or a prompt just under --max-request-bytes, ten times in a
row; /health is polled
every 25 ms and the server process's memory sampled. Reports /health latency and the streams'
token gaps during the refusal against before it, and the server's RSS before, at peak and
after. Runs on the CPU with the embedded model:

    python bench/hostile_input.py --out bench/results/hostile_input_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
FIVE_MB = 5_000_000
UNDER_LIMIT = (4 << 20) - 4096  # a body the default --max-request-bytes still parses
POLL_S = 0.025
NUM_HOSTILE = 10  # hostile requests in a row, so the window holds enough samples


def _payload(kind: str) -> tuple[bytes, dict[str, str]]:
    """The hostile request body and its headers."""
    if kind == "prompt_under_limit":  # parsed as JSON, refused before tokenizing
        prompt = "word " * ((UNDER_LIMIT - 100) // 5)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
        return body, {"content-type": "application/json"}
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * FIVE_MB + b'"}'
    return body, {"content-type": "application/json"}


def _send_hostile(url: str, kind: str, result: dict[str, Any]) -> None:
    """NUM_HOSTILE such requests one after another; their answers and seconds."""
    body, headers = _payload(kind)
    result.update(statuses=[], answered_s=[])
    for _ in range(NUM_HOSTILE):
        started = time.perf_counter()
        content: Any = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
        if kind != "chunked_5mb":
            content = body  # sent with its Content-Length
        try:
            url_path = f"{url}/v1/completions"
            response = httpx.post(url_path, content=content, headers=headers, timeout=60)
            result["statuses"].append(response.status_code)
        except httpx.HTTPError as exc:  # answered and closed before the upload ended
            result["statuses"].append(f"closed ({type(exc).__name__})")
        result["answered_s"].append(round(time.perf_counter() - started, 3))


async def _stream(client: httpx.AsyncClient, times: list[float]) -> None:
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 96, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


async def _poll(client: httpx.AsyncClient, pid: int, stop: asyncio.Event, out: dict) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await client.get("/health")
        out["health"].append((started, time.perf_counter() - started))
        out["rss"].append((started, _rss_mb(pid)))
        await asyncio.sleep(POLL_S)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def scenario(url: str, pid: int, kind: str) -> dict[str, Any]:
    samples: dict[str, list] = {"health": [], "rss": []}
    gaps: list[list[float]] = [[], []]
    stop, hostile = asyncio.Event(), dict[str, Any]()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        poller = asyncio.create_task(_poll(client, pid, stop, samples))
        streams = [asyncio.create_task(_stream(client, times)) for times in gaps]
        while min(len(times) for times in gaps) < 24:
            await asyncio.sleep(0.01)
        window_start = time.perf_counter()
        sender = threading.Thread(target=_send_hostile, args=(url, kind, hostile))
        sender.start()
        await asyncio.to_thread(sender.join)
        window_end = time.perf_counter()
        await asyncio.gather(*streams)
        await asyncio.sleep(2.0)  # memory after the refusal settles
        stop.set()
        await poller
    return _summary(kind, hostile, samples, gaps, (window_start, window_end))


def _summary(kind: str, hostile: dict, samples: dict, gaps: list, window: tuple) -> dict:
    """Figures before the first hostile request and while they were being answered."""
    start, end = window[0], window[1] + POLL_S
    health: dict[str, list[float]] = {"before": [], "during": []}
    tpot: dict[str, list[float]] = {"before": [], "during": []}
    for sent, seconds in samples["health"]:
        if sent <= end:
            health["before" if sent < start else "during"].append(seconds * 1e3)
    for times in gaps:
        for previous, arrived in zip(times, times[1:], strict=False):
            if arrived <= end:
                tpot["before" if arrived < start else "during"].append((arrived - previous) * 1e3)
    rss = [mb for _, mb in samples["rss"]]
    rss_before = [mb for sent, mb in samples["rss"] if sent < start][-1]
    return {
        "kind": kind,
        "hostile": hostile,
        "health_ms": {when: _stats(values) for when, values in health.items()},
        "tpot_ms": {when: _stats(values) for when, values in tpot.items()},
        "rss_mb": {"before": _r(rss_before), "peak": _r(max(rss)), "after": _r(rss[-1])},
    }


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": _r(statistics.median(values)), "max": _r(max(values))}


def _r(value: float) -> float:
    return round(value, 1)


@contextmanager
def server_process() -> Iterator[tuple[str, int]]:
    """`graphguard serve` (the embedded model, defaults) on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "graphguard.server.cli", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit("graphguard serve did not start")
            time.sleep(0.2)
        yield url, process.pid
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    kinds = ("declared_5mb", "chunked_5mb", "prompt_under_limit")
    with server_process() as (url, pid):
        results = [asyncio.run(scenario(url, pid, kind)) for kind in kinds]
    text = json.dumps({"cpu_count": os.cpu_count(), "scenarios": results}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
