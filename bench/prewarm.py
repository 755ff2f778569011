"""Time to first graph replay: a cold (lazy) start against a start from a graph manifest.

On the decoder step (random bf16 weights, static KV cache, context 512). A previous run captures
every batch bucket and exports a manifest. Then two fresh runners serve the same stream of
calls (batch sizes drawn from 1..32): "lazy" captures a bucket once it has earned it (default
admission); "manifest" first prewarms from the manifest, as `graphguard serve --graph-manifest`
does. Timed from the runner's creation: the first call served by a graph, the point where every
bucket has been served by a graph, and the whole stream.

    python bench/prewarm.py [--shape qwen3-0.6b] [--calls 64]
    python bench/prewarm.py --device cpu --shape tiny   # SimBackend smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Pinned cuBLAS workspaces: the same kernels on every stream (docs/runtime.md).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphguard as gg  # noqa: E402
from bench.decoder_step import SHAPES, DecoderStep, step_inputs  # noqa: E402
from bench.timing import sync, write_json  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32)
CONTEXT = 512


def new_runner(step: DecoderStep, backend: str, **kwargs: Any) -> gg.GraphRunner:
    return gg.GraphRunner(
        step,
        buckets=gg.Buckets(batch=BUCKETS),
        max_bytes=16 << 30,
        backend=backend,
        name="decoder",
        **kwargs,
    )


def write_manifest(step: DecoderStep, backend: str, path: Path) -> dict[str, Any]:
    """The previous run: capture every bucket, export, and retire the graphs."""
    device = step.k_cache.device
    runner = new_runner(step, backend)
    report = runner.warmup(
        [step_inputs(b, CONTEXT, device, vocab=step.shape.vocab) for b in BUCKETS], progress=False
    )
    assert not report.skipped, report.skipped
    manifest = runner.export(path)
    runner.close()
    return manifest


def call_stream(step: DecoderStep, num_calls: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, max(BUCKETS) + 1, (num_calls,), generator=g).tolist()
    device = step.k_cache.device
    return [
        step_inputs(int(n), CONTEXT, device, seed=i, vocab=step.shape.vocab)
        for i, n in enumerate(sizes)
    ]


def serve(step: DecoderStep, backend: str, calls: list, manifest: Path | None) -> dict[str, Any]:
    """Create a runner (prewarmed when `manifest` is given) and serve `calls`; timings in s."""
    sync()
    start = time.perf_counter()
    runner = new_runner(step, backend)
    report = runner.prewarm(manifest, progress=False) if manifest else None
    prewarm_s, prewarmed = (report.seconds, len(report.captured)) if report else (0.0, 0)
    first_replay_s = all_buckets_s = None
    served: set[int] = set()
    for ids, pos in calls:
        replays = runner.stats()["replays"]
        runner(ids, pos)
        sync()
        if runner.stats()["replays"] > replays:
            now = time.perf_counter() - start
            first_replay_s = first_replay_s if first_replay_s is not None else now
            served.add(next(b for b in BUCKETS if b >= ids.shape[0]))
            if len(served) == len(BUCKETS) and all_buckets_s is None:
                all_buckets_s = now
    stats = runner.stats()
    runner.close()
    return dict(
        prewarm_s=prewarm_s,
        first_replay_s=first_replay_s,
        all_buckets_s=all_buckets_s,
        stream_s=time.perf_counter() - start,
        prewarmed=prewarmed,
        captures_while_serving=stats["captures"] - prewarmed,
        eager_calls=sum(stats["fallbacks"].values()),
    )


def measure(shape: str, num_calls: int, device: torch.device) -> dict[str, Any]:
    backend = "cuda" if device.type == "cuda" else "sim"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    step = DecoderStep(
        SHAPES[shape], max_batch=max(BUCKETS), context=CONTEXT, dtype=dtype, device=device
    )
    step(*step_inputs(max(BUCKETS), CONTEXT, device, vocab=step.shape.vocab))  # load kernels
    calls = call_stream(step, num_calls)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "decoder.json"
        manifest = write_manifest(step, backend, path)
        rows = {
            "lazy": serve(step, backend, calls, None),
            "manifest": serve(step, backend, calls, path),
        }
    return dict(
        shape=shape,
        context=CONTEXT,
        dtype=str(dtype).removeprefix("torch."),
        buckets=list(BUCKETS),
        calls=num_calls,
        manifest_graphs=len(manifest["graphs"]),
        rows=rows,
    )


def print_table(result: dict[str, Any]) -> None:
    head = ("start", "prewarm s", "1st replay s", "all buckets s", "stream s", "captures")
    print(" ".join(f"{h:>13}" for h in head))
    for name, r in result["rows"].items():
        cells = [
            name,
            r["prewarm_s"],
            r["first_replay_s"],
            r["all_buckets_s"],
            r["stream_s"],
            r["captures_while_serving"],
        ]
        print(" ".join(_cell(c) for c in cells))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:>13.3f}"
    return f"{'-' if value is None else value:>13}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    result = measure(args.shape, args.calls, torch.device(args.device))
    path = write_json("prewarm.json", result)
    print(f"prewarm ({args.shape}, {result['dtype']}, ctx {CONTEXT}, {args.calls} calls) -> {path}")
    print_table(result)


if __name__ == "__main__":
    main()
