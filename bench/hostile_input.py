"""What one hostile client costs everyone else. While two greedy streams run, the bench goes
through three kinds of phase of PHASE_S seconds: `quiet`, `control` (a client uploads a
hostile body REQUESTS_PER_S times a second to a plain socket sink that reads each one whole,
keeps none of it and answers 413) and `hostile` (the same client, bodies, 64 KiB chunks and
pace, sent to the server). PHASES runs them in the order quiet, control, hostile, hostile,
control, quiet, NUM_ROUNDS times, so that a drift of the machine's load cancels out. The
bodies: 5 MB with its Content-Length, 5 MB chunked, or a JSON prompt just under
--max-request-bytes. /health is polled every 25 ms, the server process's memory and CPU time
sampled.

Reports, for each kind of phase, the streams' token gaps (TPOT), /health latency and the
server's CPU use (cores); for control and hostile what the client sent, got and used of the
CPU; and the server's RSS before the first hostile phase, at its peak and after. The client
and the sink are processes of their own (this file with --send / --sink): they share no
interpreter lock with the streams' reader or the server, only the machine's cores. Streams
that slow down as much in the control as in the hostile phase pay for the client's CPU, not
for the server's work. Runs on the CPU with the embedded model:

    python bench/hostile_input.py --out bench/results/hostile_input_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_serve import free_port, local_serve  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
KINDS = ("declared_5mb", "chunked_5mb", "prompt_under_limit")
FIVE_MB = 5_000_000
UNDER_LIMIT = (4 << 20) - 4096  # a body the default --max-request-bytes still parses
CHUNK_BYTES = 65536  # the client hands its body over in pieces of this size
PHASES = ("quiet", "control", "hostile", "hostile", "control", "quiet")  # a drift cancels out
PHASE_S = 3.0
NUM_ROUNDS = 2  # PHASES this many times, so each figure pools 12 s
CLIENTS = ("control", "hostile")  # the phases with a client, the sink's and the server's
REQUESTS_PER_S = 10.0  # the client's pace in both phases, so that both do the same work
POLL_S = 0.025
SINK_ANSWER = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def payload(kind: str) -> tuple[bytes, dict[str, str]]:
    """The hostile request body and its headers."""
    headers = {"content-type": "application/json"}
    if kind == "prompt_under_limit":  # parsed as JSON, refused before tokenizing
        prompt = "word " * ((UNDER_LIMIT - 100) // 5)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    else:
        body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * FIVE_MB + b'"}'
    if kind != "chunked_5mb":  # an iterator is sent chunked unless its length is declared
        headers["content-length"] = str(len(body))
    return body, headers


def send(url: str, kind: str, seconds: float, requests_per_s: float) -> dict[str, Any]:
    """The hostile client: the same request `requests_per_s` times a second (0: back to back)
    for `seconds`; what it sent and got."""
    body, headers = payload(kind)
    statuses: Counter[str] = Counter()
    answered_ms: list[float] = []
    num_sent = 0  # body bytes the client handed to its connection

    def chunks() -> Iterator[bytes]:
        nonlocal num_sent
        for start in range(0, len(body), CHUNK_BYTES):
            num_sent += min(CHUNK_BYTES, len(body) - start)
            yield body[start : start + CHUNK_BYTES]

    started, cpu_started = time.perf_counter(), time.process_time()
    with httpx.Client(timeout=60) as client:
        while (sent_at := time.perf_counter()) < started + seconds:
            try:
                response = client.post(f"{url}/v1/completions", content=chunks(), headers=headers)
                statuses[str(response.status_code)] += 1
            except httpx.HTTPError as exc:  # answered and closed before the upload ended
                statuses[f"closed ({type(exc).__name__})"] += 1
            answered_ms.append((time.perf_counter() - sent_at) * 1e3)
            if requests_per_s:  # on a schedule, back to back when late
                next_at = started + len(answered_ms) / requests_per_s
                time.sleep(max(0.0, min(next_at, started + seconds) - time.perf_counter()))
    return {"window": [started, time.perf_counter()], "statuses": statuses,
            "answered_ms": answered_ms, "uploaded_bytes": num_sent,
            "cpu_s": time.process_time() - cpu_started}  # fmt: skip


def sink(listener: socket.socket) -> None:
    """Reads each request on `listener` whole (Content-Length or chunked), keeps none of it,
    answers 413 and closes; one connection at a time, for ever."""
    while True:
        connection, _ = listener.accept()
        with connection:
            _discard_request(connection)
            connection.sendall(SINK_ANSWER)


def _discard_request(connection: socket.socket) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        data = connection.recv(CHUNK_BYTES)
        if not data:  # closed without a request (the bench's own check that it listens)
            return
        head += data
    head, rest = head.split(b"\r\n\r\n", 1)
    lines = [line.lower() for line in head.split(b"\r\n")]
    lengths = [int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:")]
    num_left = lengths[0] - len(rest) if lengths else None
    tail = rest[-5:]  # a chunked body ends with the empty chunk "0\r\n\r\n"
    while (num_left > 0) if num_left is not None else not tail.endswith(b"0\r\n\r\n"):
        data = connection.recv(1 << 20)
        if not data:
            return
        if num_left is not None:
            num_left -= len(data)
        tail = (tail + data)[-5:]


async def _stream(client: httpx.AsyncClient, times: list[float]) -> None:
    """A greedy stream long enough for all phases (cancelled at the end)."""
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


async def _poll(client: httpx.AsyncClient, pid: int, samples: dict[str, list]) -> None:
    while True:
        started = time.perf_counter()
        await client.get("/health")
        samples["health"].append((started, time.perf_counter() - started))
        samples["rss"].append((started, _rss_mb(pid)))
        samples["cpu"].append((started, _cpu_s(pid)))
        await asyncio.sleep(POLL_S)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    """CPU seconds the process has used, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run_sender(url: str, kind: str, requests_per_s: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--send", url, "--kind", kind,
               "--requests-per-s", str(requests_per_s)]  # fmt: skip
    process = await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE)
    stdout, _ = await process.communicate()
    return dict(json.loads(stdout))


async def _phase(phase: str, urls: dict[str, str], kind: str, requests_per_s: float) -> dict:
    """One phase's window; in control and hostile phases, what the client sent and got too."""
    if phase != "quiet":
        return await _run_sender(urls[phase], kind, requests_per_s)
    started = time.perf_counter()
    await asyncio.sleep(PHASE_S)
    return {"window": [started, time.perf_counter()]}


async def scenario(urls: dict[str, str], pid: int, kind: str, requests_per_s: float) -> dict:
    """PHASES while two streams run; `urls` names the server for "hostile", the sink for
    "control"."""
    samples: dict[str, list] = {"health": [], "rss": [], "cpu": []}
    gaps: list[list[float]] = [[], []]
    phases: list[tuple[str, dict]] = []
    async with httpx.AsyncClient(base_url=urls["hostile"], timeout=120) as client:
        tasks = [asyncio.create_task(_stream(client, times)) for times in gaps]
        tasks.append(asyncio.create_task(_poll(client, pid, samples)))
        while min(len(times) for times in gaps) < 16:  # both streams are decoding
            await asyncio.sleep(0.01)
        for phase in PHASES * NUM_ROUNDS:
            phases.append((phase, await _phase(phase, urls, kind, requests_per_s)))
        await asyncio.sleep(2.0)  # memory after the refusals settles
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"kind": kind, **_summary(phases, samples, gaps)}


def _summary(phases: list[tuple[str, dict]], samples: dict, gaps: list) -> dict:
    """Each kind of phase's figures: what arrived inside its windows."""
    health: dict[str, list[float]] = {phase: [] for phase, _ in phases}
    tpot: dict[str, list[float]] = {phase: [] for phase, _ in phases}
    cpu: dict[str, list[float]] = {phase: [0.0, 0.0] for phase, _ in phases}  # cpu s, s
    for phase, ran in phases:
        start, end = ran["window"]
        health[phase] += [s * 1e3 for sent, s in samples["health"] if start <= sent < end]
        for times in gaps:
            pairs = zip(times, times[1:], strict=False)
            tpot[phase] += [(b - a) * 1e3 for a, b in pairs if start <= b < end]
        inside = [(sent, s) for sent, s in samples["cpu"] if start <= sent < end]
        cpu[phase][0] += inside[-1][1] - inside[0][1]
        cpu[phase][1] += inside[-1][0] - inside[0][0]
    rss = samples["rss"]
    hostile_start = min(ran["window"][0] for phase, ran in phases if phase == "hostile")
    return {
        "tpot_ms": {phase: _stats(values) for phase, values in tpot.items()},
        "health_ms": {phase: _stats(values) for phase, values in health.items()},
        "server_cpu_cores": {phase: round(used / s, 2) for phase, (used, s) in cpu.items()},
        "client": {
            kind: _client([ran for name, ran in phases if name == kind]) for kind in CLIENTS
        },
        "rss_mb": {
            "before": _r([mb for sent, mb in rss if sent < hostile_start][-1]),
            "peak": _r(max(mb for sent, mb in rss if sent >= hostile_start)),
            "after": _r(rss[-1][1]),
        },
    }


def _client(runs: list[dict]) -> dict[str, Any]:
    """What the client sent and got over `runs`."""
    statuses: Counter[str] = Counter()
    for run in runs:
        statuses.update(run["statuses"])
    answered_ms = [ms for run in runs for ms in run["answered_ms"]]
    uploaded_bytes = sum(run["uploaded_bytes"] for run in runs)
    seconds = sum(run["window"][1] - run["window"][0] for run in runs)
    return {
        "num_requests": len(answered_ms),
        "statuses": dict(statuses),
        "answered_ms": _stats(answered_ms),
        "uploaded_mb_per_request": round(uploaded_bytes / len(answered_ms) / 1e6, 2),
        "cpu_cores": round(sum(run["cpu_s"] for run in runs) / seconds, 2),
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
    with local_serve(["--log-level", "warning"], timeout_s=180) as server:
        yield server.url, server.pid


@contextmanager
def sink_process() -> Iterator[str]:
    """`sink` in a process of its own on a free loopback port."""
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--sink", str(port)])
    try:
        while not _is_listening(port):
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def _is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--requests-per-s", type=float, default=REQUESTS_PER_S,
                        help="the client's pace; 0: back to back")  # fmt: skip
    parser.add_argument("--send", metavar="URL", help=argparse.SUPPRESS)  # the client
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.send:
        print(json.dumps(send(args.send, args.kind, PHASE_S, args.requests_per_s)))
        return 0
    if args.sink:
        with socket.create_server(("127.0.0.1", args.sink)) as listener:
            sink(listener)
    with server_process() as (url, pid), sink_process() as sink_url:
        urls = {"hostile": url, "control": sink_url}
        results = [asyncio.run(scenario(urls, pid, kind, args.requests_per_s))
                   for kind in args.kinds]  # fmt: skip
    report = {"cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
              "phase_s": PHASE_S, "requests_per_s": args.requests_per_s,
              "scenarios": results}  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
