"""Load test for `graphguard serve` over loopback: a fixed number of streaming requests at a
fixed concurrency; reports requests/s, tokens/s, TTFT and TPOT percentiles and, with graphs on,
what the decode and prefill graphs did during the load (captures, hit rate, fallbacks by reason,
the longest unit of a capture between steps), and writes JSON (bench/serve_compare.py puts
several runs side by side).

    python bench/serve_load.py                       # starts `graphguard serve` (embedded model)
    python bench/serve_load.py --url http://127.0.0.1:8000 --num-requests 200 --concurrency 32
    python bench/serve_load.py --clients 4 --concurrency 16   # 4 processes of 16 streams each
    python bench/serve_load.py --offline --model-path M ...   # served / offline, side by side

Requests use `ignore_eos` so every one generates exactly --max-tokens tokens. With `--clients N`
the load comes from N client processes, each with --concurrency streams, so that one client's
interpreter does not cap the load; the report says which side was the bound (bench/load_bounds.py:
client CPU against wall, the server's and the engine process's CPU, and the engine's step
interval against the gap between a stream's tokens). With `--offline`, after the server has
stopped, the same requests (prompts, --max-tokens, --max-num-seqs, graph flags) go through the
offline `LLM` API in this process, once untimed and once timed, and the report gives
served / offline output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_bounds import (  # noqa: E402
    ClientRun,
    bound_report,
    cpu_seconds,
    engine_counts,
    listener_pid,
)
from bench.local_serve import StreamReading, local_serve, stream_body  # noqa: E402

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the planet Mars.",
    "Describe a busy market on a Saturday morning.",
)


@dataclass(frozen=True)
class RequestResult:
    sent_s: float  # when the request was sent, from the start of the load
    ttft_s: float  # request sent -> first generated text
    tpot_s: float | None  # mean gap between later tokens; None with one token
    latency_s: float
    num_output_tokens: int


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def prompt_of(index: int, spread: int) -> str:
    """Request `index`'s prompt: one of PROMPTS, with up to `spread` - 1 words more (spread > 0
    varies the prompt lengths, so prefill shapes churn)."""
    extra = (index * 7) % spread if spread > 0 else 0
    return PROMPTS[index % len(PROMPTS)] + " Please" * extra


async def one_request(
    session: aiohttp.ClientSession,
    model: str,
    index: int,
    args: argparse.Namespace,
    load_start: float,
) -> RequestResult:
    body = stream_body(model, prompt_of(index, args.prompt_spread), args.max_tokens)
    start = time.perf_counter()
    reading = StreamReading()
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:  # split at b"\n"
            reading.feed(line.decode().rstrip("\r\n"))
    first, last, num_tokens = reading.first_text_s, reading.last_text_s, reading.num_tokens
    assert first is not None and last is not None, "the stream produced no text"
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return RequestResult(start - load_start, first - start, tpot, last - start, num_tokens)


async def run_load(
    url: str, model: str, args: argparse.Namespace, indices: range | None = None
) -> list[RequestResult]:
    """Requests `indices` (default: all of them), at most --concurrency at a time.

    NOTE: aiohttp, whose HTTP parser is compiled, reads a streamed token for about a third of
    the CPU httpx takes (33-38 against 85-109 us on a 2-core EPYC): with httpx, four client
    processes alone could not read what an H200 makes at 64 streams."""
    semaphore = asyncio.Semaphore(args.concurrency)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    # a stream may run long: what is bounded is a connect and each wait for bytes, not the whole
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=600, sock_read=600)
    origin = urlparse(url)._replace(path="", params="", query="", fragment="").geturl()
    load_start = time.perf_counter()
    async with aiohttp.ClientSession(
        origin, connector=connector, timeout=timeout, read_bufsize=2**20
    ) as session:

        async def bounded(index: int) -> RequestResult:
            async with semaphore:
                return await one_request(session, model, index, args, load_start)

        chosen = range(args.num_requests) if indices is None else indices
        return await asyncio.gather(*(bounded(i) for i in chosen))


def client_process(url: str, model: str, args: argparse.Namespace, index: int) -> ClientRun:
    """Client `index` of --clients: requests index, index + clients, ...; with its CPU time.
    In a client process it starts once every client is ready (`_await_start`)."""
    if _START is not None:
        _START.wait()
    cpu, wall = time.process_time(), time.perf_counter()
    indices = range(index, args.num_requests, args.clients)
    results = asyncio.run(run_load(url, model, args, indices))
    return ClientRun(results, time.process_time() - cpu, time.perf_counter() - wall)


_START: Any = None  # a client process's start barrier (multiprocessing.Barrier)


def _await_start(barrier: Any) -> None:
    global _START
    _START = barrier


def run_clients(url: str, model: str, args: argparse.Namespace) -> tuple[list[ClientRun], float]:
    """The load from --clients processes (here, when one), each with --concurrency streams, and
    its wall seconds.

    NOTE: the clock starts when every client process has started and imported what it needs
    (a barrier), not when they are launched: starting four processes took about 0.5 s on the
    H200 host, a third of the wall of a 64-stream load of 256 short requests there."""
    if args.clients == 1:
        start = time.perf_counter()
        return [client_process(url, model, args, 0)], time.perf_counter() - start
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(args.clients + 1)
    with ProcessPoolExecutor(
        args.clients, mp_context=context, initializer=_await_start, initargs=(barrier,)
    ) as pool:
        runs = [pool.submit(client_process, url, model, args, i) for i in range(args.clients)]
        barrier.wait(timeout=120)
        start = time.perf_counter()
        done = [run.result() for run in runs]
        return done, time.perf_counter() - start


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, float]:
    ttfts = [r.ttft_s for r in results]
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    num_tokens = sum(r.num_output_tokens for r in results)
    ms = 1000.0
    return {
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(results) / wall_s, 3),
        "output_tokens_per_s": round(num_tokens / wall_s, 1),
        "ttft_p50_ms": round(percentile(ttfts, 50) * ms, 1),
        "ttft_p99_ms": round(percentile(ttfts, 99) * ms, 1),
        "tpot_p50_ms": round(percentile(tpots, 50) * ms, 2) if tpots else float("nan"),
        "tpot_p99_ms": round(percentile(tpots, 99) * ms, 2) if tpots else float("nan"),
        "latency_mean_ms": round(statistics.fmean(r.latency_s for r in results) * ms, 1),
        "num_output_tokens": num_tokens,
    }


def server_flags(args: argparse.Namespace) -> list[str]:
    """The `graphguard serve` flags of the local server.

    A separate process keeps the load generator's event loop off the server's interpreter lock,
    as it is with real clients.
    """
    flags = ["--device", args.device, "--max-num-seqs", str(args.max_num_seqs)]
    flags += ["--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    flags += ["--model", args.model_path] if args.model_path else []
    flags += ["--enforce-eager"] if args.enforce_eager else []
    flags += ["--warmup-graphs"] if args.warmup_graphs else []
    flags += ["--no-background-capture"] if args.no_background_capture else []
    flags += ["--no-engine-process"] if args.in_process else []
    flags += ["--kernels", args.kernels] if args.kernels else []
    flags += ["--api-server-count", str(args.api_server_count)]
    return flags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server on loopback; default: start one here")
    parser.add_argument("--model", help="model id to send; default: the server's only model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="streams per client")
    parser.add_argument("--clients", type=int, default=1, help="client processes")
    parser.add_argument(
        "--in-process", action="store_true", help="local server: the engine on a thread of it"
    )
    parser.add_argument("--kernels", help="local server: its --kernels")
    parser.add_argument(
        "--api-server-count", type=int, default=1, help="local server: its HTTP processes"
    )
    parser.add_argument("--server-pid", type=int, help="with --url: the server's process id")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--prompt-spread", type=int, default=0, help="vary prompt lengths by up to N-1 words"
    )
    parser.add_argument("--device", default="auto", help="for the local server")
    parser.add_argument("--model-path", help="local server: a model folder or .gguf file")
    parser.add_argument("--enforce-eager", action="store_true", help="local server: no graphs")
    parser.add_argument(
        "--warmup-graphs", action="store_true", help="local server: capture decode graphs at start"
    )
    parser.add_argument(
        "--no-background-capture",
        action="store_true",
        help="local server: capture graphs inside the step that earns them",
    )
    parser.add_argument("--mode", help="a label for this run in the report (serve_compare.py)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="for the local server")
    parser.add_argument("--max-model-len", type=int, default=512, help="local server")
    parser.add_argument(
        "--start-timeout", type=float, default=900, help="seconds to wait for the server"
    )
    parser.add_argument(
        "--offline", action="store_true", help="also the same requests through `LLM`, here"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_load.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and urlparse(args.url).hostname not in LOOPBACK_HOSTS:
        sys.exit(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK_HOSTS))})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with _server(args) as (url, model, start_s):
        model = args.model or model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        if args.offline:  # the offline side is timed warm: so is this one
            run_clients(url, model, args)
        # Other work on the host skews CPU numbers: record the load around the run.
        load_before = os.getloadavg()[0]
        graphs_before = httpx.get(f"{url}/v1/graphs").json()
        server_pid = args.server_pid or listener_pid(urlparse(url).port or 80)
        port = urlparse(url).port
        cpu_before, counts_before = cpu_seconds(server_pid, port), engine_counts(url)
        start_unix = time.time()
        runs, wall_s = run_clients(url, model, args)
        cpu_after, counts_after = cpu_seconds(server_pid, port), engine_counts(url)
        results = [result for run in runs for result in run.results]
        summary: dict[str, Any] = summarize(results, wall_s)
        tpots = [r.tpot_s for r in results if r.tpot_s is not None]
        tpot_p50 = percentile(tpots, 50) if tpots else None
        summary["bounds"] = bound_report(
            runs, wall_s, cpu_before, cpu_after, counts_before, counts_after, tpot_p50
        )
        graphs = httpx.get(f"{url}/v1/graphs").json()
    if args.offline:
        offline = offline_rate(args)
        summary["offline_output_tokens_per_s"] = offline
        summary["served_over_offline"] = round(summary["output_tokens_per_s"] / offline, 3)
    if graphs.get("enabled", True):
        # What the graphs did while the load ran: captures, hit rate, fallbacks by reason.
        summary.update(graphs_during_load("decode", graphs_before, graphs))
        summary["graphs_resident"] = graphs["entries"]
        if graphs.get("prefill") and graphs_before.get("prefill"):
            summary.update(
                graphs_during_load("prefill", graphs_before["prefill"], graphs["prefill"])
            )
            if graphs["prefill"].get("rows") and graphs_before["prefill"].get("rows"):
                # short prefills, run as rows through whole graphs
                rows_before, rows = graphs_before["prefill"]["rows"], graphs["prefill"]["rows"]
                summary.update(graphs_during_load("prefill_rows", rows_before, rows))
            if graphs["prefill"].get("whole") and graphs_before["prefill"].get("whole"):
                # packed prefills as whole graphs (the fused kernels); its fallbacks were
                # answered by the segments, counted under "prefill"
                whole_before, whole = graphs_before["prefill"]["whole"], graphs["prefill"]["whole"]
                summary.update(graphs_during_load("prefill_whole", whole_before, whole))
    report = {
        "benchmark": "serve_load",
        "mode": args.mode or _default_mode(args) + ("-in-process" if args.in_process else ""),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "model": model,
        "summary": summary,
        "server_start_s": start_s,
        # the load's start by the wall clock: a server's step trace (GRAPHGUARD_STEP_TRACE)
        # lines up with the requests' sent_s through it
        "load_start_unix": round(start_unix, 6),
        "graphs_enabled": graphs.get("enabled", True),
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": os.getloadavg()[0],
        },
        "requests": [asdict(r) for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({"model": model, "server_start_s": start_s, **summary}, indent=2))
    print(f"wrote {args.out}")
    return 0


def offline_rate(args: argparse.Namespace) -> float:
    """Output tokens/s of the load's requests through the offline `LLM` API in this process, the
    engine configured as the local server was; the second of two runs (the first warms it)."""
    from graphguard.engine.llm import LLM
    from graphguard.engine.tokens.sampling import SamplingParams

    llm = LLM(
        args.model_path,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        warmup_graphs=args.warmup_graphs,
        **({"kernels": args.kernels} if args.kernels else {}),
    )
    # NOTE: as `graphguard serve` does once loaded (cli.prepare_interpreter): what was made
    # so far leaves the collector's reach, so the offline side is timed at its best. On the
    # H200 at one stream it made 808 tok/s without this and 937 with it (run 82).
    gc.collect()
    gc.freeze()
    try:
        prompts = [prompt_of(i, args.prompt_spread) for i in range(args.num_requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    return round(sum(len(o.outputs[0].token_ids) for o in outputs) / wall_s, 1)


def graphs_during_load(name: str, before: dict, after: dict) -> dict[str, Any]:
    """One runner's counts over the load (the /v1/graphs stats after minus before)."""
    calls = after["calls"] - before["calls"]
    replays = after["replays"] - before["replays"]
    fallbacks = {
        reason: count - before["fallbacks"].get(reason, 0)
        for reason, count in after["fallbacks"].items()
        if count - before["fallbacks"].get(reason, 0)
    }
    return {
        f"{name}_captures": after["captures"] - before["captures"],
        f"{name}_captures_cancelled": after.get("captures_cancelled", 0)
        - before.get("captures_cancelled", 0),
        f"{name}_calls": calls,
        f"{name}_hit_rate": round(replays / calls, 4) if calls else 0.0,
        # of the replays, calls a larger bucket's graph answered (GraphRunner max_pad_factor)
        f"{name}_covered": after.get("covered", 0) - before.get("covered", 0),
        f"{name}_fallbacks": fallbacks,
        # the longest unit of work a capture between steps added to one step (0: none ran)
        f"{name}_capture_unit_max_ms": after.get("background_unit_max_ms", 0.0),
        # the mean work of an admitted capture, at start and during the load (payback's price)
        f"{name}_capture_price_ms": after.get("capture_price_ms"),
    }


def _default_mode(args: argparse.Namespace) -> str:
    if args.url:
        return "external"
    if args.enforce_eager:
        return "eager"
    if args.warmup_graphs:
        return "graphs-warm"
    return "graphs-sync" if args.no_background_capture else "graphs"


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, str | None, float | None]]:
    if args.url:
        yield args.url.rstrip("/"), None, None
        return
    with local_serve(server_flags(args), timeout_s=args.start_timeout) as server:
        args.server_pid = args.server_pid or server.pid
        yield server.url, None, server.start_s


if __name__ == "__main__":
    sys.exit(main())
