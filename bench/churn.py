"""Shape churn: eager vs naive capture-on-miss vs graphguard's admission, side by side.

Four workloads on the Qwen3-0.6B-shaped decoder step (bf16, context 512), each key a distinct
batch size: steady (one shape), fitting (four shapes, all fit), churn (eight shapes cycling,
the budget holds three), zipf (32 shapes, Zipf s=1.1, the budget holds eight). Per-call p50/p99.
Targets: churn p50 <= 1.05x eager; steady and fitting keep >= 90% of the graph speedup; zipf
p50 >= 2x better than eager.

    python bench/churn.py [--shape qwen3-0.6b] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

# Pinned cuBLAS workspaces: the same kernels on every stream (docs/runtime.md).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphguard as gg  # noqa: E402
from bench.decoder_step import SHAPES, DecoderStep, step_inputs  # noqa: E402
from bench.timing import latencies_ms, out_dir, percentile, write_json  # noqa: E402

NAIVE = gg.AdmissionConfig(
    min_hits=1, frequency_aware=False, max_capture_fraction=1.0, max_recaptures=1 << 30
)


def workloads(scale: float, seed: int = 0) -> dict[str, tuple[list[int], int]]:
    """name -> (batch size of each call, how many of the largest graphs the budget holds)."""
    rng = random.Random(seed)
    n = lambda base: max(16, int(base * scale))  # noqa: E731
    zipf_weights = [1 / (k**1.1) for k in range(1, 33)]
    return {
        "steady": ([4] * n(100), 1),
        "fitting": ([rng.choice([1, 2, 3, 4]) for _ in range(n(100))], 4),
        "churn": ([1 + i % 8 for i in range(n(160))], 3),
        "zipf": (rng.choices(range(1, 33), weights=zipf_weights, k=n(320)), 8),
    }


def graph_bytes(step: DecoderStep, batch: int, device) -> int:
    runner = gg.GraphRunner(step, admission=NAIVE, verify="off")
    runner(*step_inputs(batch, 512, device, vocab=step.shape.vocab))
    size = runner.stats()["resident_bytes"]
    runner.close()
    return size


def run_mode(mode: str, step: DecoderStep, calls: list[tuple], budget: int) -> dict:
    if mode == "eager":
        lat = latencies_ms([partial(step, *a) for a in calls])
        return dict(p50=percentile(lat, 50), p99=percentile(lat, 99))
    admission = NAIVE if mode == "naive" else gg.AdmissionConfig()
    runner = gg.GraphRunner(
        step,
        max_bytes=budget,
        admission=admission,
        verify="off" if mode == "naive" else "exact",
        capture=gg.CaptureConfig(copy_outputs=False),
    )
    lat = latencies_ms([partial(runner, *a) for a in calls])
    stats = runner.stats()
    runner.close()
    return dict(
        p50=percentile(lat, 50),
        p99=percentile(lat, 99),
        captures=stats["captures"],
        evictions=stats["evictions"],
        hit_rate=stats["hit_rate"],
        fallbacks=stats["fallbacks"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the call counts")
    args = parser.parse_args()
    device = torch.device("cuda")
    step = DecoderStep(
        SHAPES[args.shape], max_batch=32, context=512, dtype=torch.bfloat16, device=device
    )
    results: dict[str, dict[str, Any]] = {}
    for name, (batches, holds) in workloads(args.scale).items():
        budget = holds * graph_bytes(step, max(batches), device)
        calls = [
            step_inputs(b, 512, device, seed=i, vocab=step.shape.vocab)
            for i, b in enumerate(batches)
        ]
        results[name] = {
            m: run_mode(m, step, calls, budget) for m in ("eager", "naive", "graphguard")
        }
        results[name]["budget_bytes"] = budget
        results[name]["num_calls"] = len(calls)
    path = write_json("churn.json", dict(shape=args.shape, results=results))
    plot(results)
    print(f"churn ({args.shape}) -> {path}")
    print(
        f"{'workload':>9} {'eager p50':>9} {'naive p50':>9} {'gg p50':>8} {'gg p99':>8} "
        f"{'gg/eager':>8} {'naive caps':>10} {'gg caps':>7}"
    )
    for name, r in results.items():
        e, nv, g = r["eager"], r["naive"], r["graphguard"]
        print(
            f"{name:>9} {e['p50']:>9.2f} {nv['p50']:>9.2f} {g['p50']:>8.2f} {g['p99']:>8.2f} "
            f"{g['p50'] / e['p50']:>8.3f} {nv['captures']:>10} {g['captures']:>7}"
        )


def plot(results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names, modes = list(results), ("eager", "naive", "graphguard")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, mode in enumerate(modes):
        xs = [j + (i - 1) * 0.27 for j in range(len(names))]
        ax.bar(xs, [results[n][mode]["p50"] for n in names], width=0.27, label=mode)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("p50 per call (ms, log)")
    ax.set_title("Shape churn: per-call p50 by workload and mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir() / "churn.png", dpi=120)


if __name__ == "__main__":
    main()
