"""How long `graphguard serve` takes to start: launch to a healthy server and to the first
answer, warm (the embedded model's converted weights and the compiled kernels already cached
by an earlier start), and how soon a start on a port already in use fails.

    python -m bench.serve_start --rounds 3 --out bench/results/cpu_serve_start.json

Without --model, --device or --kernels on a machine without CUDA it serves with `--kernels q4`,
as tools/serve does. The first round warms the caches and is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.local_serve import local_serve


def default_flags(flags: list[str]) -> list[str]:
    import torch

    chosen = any(f.split("=")[0] in ("--model", "--device", "--kernels") for f in flags)
    if chosen or torch.cuda.is_available():
        return flags
    return ["--kernels", "q4", *flags]


def one_start(flags: list[str]) -> dict[str, float]:
    """Launch to healthy, and launch to the first completion's answer (one token)."""
    started = time.perf_counter()
    with local_serve(flags, timeout_s=600) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        answer.raise_for_status()
        first_answer_s = time.perf_counter() - started
    return {"healthy_s": server.start_s, "first_answer_s": round(first_answer_s, 2)}


def port_taken(flags: list[str]) -> dict[str, float | int | str]:
    """A start on a port another socket holds: its exit status, time and last line."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        command = [sys.executable, "-m", "graphguard.server.cli", "--port", str(port), *flags]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        took = time.perf_counter() - started
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"exit_status": done.returncode, "s": round(took, 2), "said": lines[-1] if lines else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="warm starts, after the first")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_start.json"))
    args, extra = parser.parse_known_args(argv)
    flags = default_flags(extra)
    first = one_start(flags)
    print(f"first start (warming the caches): {first}", flush=True)
    warm = []
    for index in range(args.rounds):
        warm.append(one_start(flags))
        print(f"warm start {index + 1}: {warm[-1]}", flush=True)
    taken = port_taken(flags)
    print(f"port in use: {taken}", flush=True)
    summary = {
        "warm_first_answer_s_median": statistics.median(w["first_answer_s"] for w in warm),
        "warm_first_answer_s_max": max(w["first_answer_s"] for w in warm),
        "warm_healthy_s_median": statistics.median(w["healthy_s"] for w in warm),
        "port_in_use_s": taken["s"],
    }
    report = {
        "flags": flags,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "first": first,
        "warm": warm,
        "port_in_use": taken,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
