"""Replay overhead: eager vs raw torch.cuda.CUDAGraph vs GraphRunner, side by side.

On a Qwen3-0.6B-shaped decoder step (random bf16 weights, static KV cache, context 512), at
batch 1, 8 and 32. Targets: GraphRunner within 3% of raw replay at batch 1 (about 8.5x faster
than eager there) and a capture under 100 ms per shape.

Small-graph rows, batch 1, bf16: a 48-block 1024-wide MLP (a graph of about 0.7 ms) and the
same with 1 block, where the GPU finishes before the host can launch the next call, so the
time per call is host time. Target: GraphRunner at most 15 us a call over raw replay.

    python bench/replay_overhead.py [--shape qwen3-0.6b] [--iters 50]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

# Pinned cuBLAS workspaces: the same kernels on every stream (docs/runtime.md).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphguard as gg  # noqa: E402
from bench.decoder_step import SHAPES, DecoderStep, step_inputs  # noqa: E402
from bench.timing import per_call_ms, write_json  # noqa: E402

BATCHES = (1, 8, 32)


def raw_graph(step: DecoderStep, ids: torch.Tensor, pos: torch.Tensor):
    """The baseline: a hand-captured CUDAGraph; each call copies inputs in and replays."""
    static_ids, static_pos = ids.clone(), pos.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(static_ids, static_pos)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_ids, static_pos)

    def call(new_ids: torch.Tensor, new_pos: torch.Tensor) -> torch.Tensor:
        static_ids.copy_(new_ids)
        static_pos.copy_(new_pos)
        graph.replay()
        return static_out

    return call, graph


def measure_batch(step: DecoderStep, runner: gg.GraphRunner, batch: int, iters: int) -> dict:
    ids, pos = step_inputs(batch, 512, step.k_cache.device, vocab=step.shape.vocab)
    eager = per_call_ms(lambda: step(ids, pos), iters=max(5, iters // 5))
    raw, graph = raw_graph(step, ids, pos)
    raw_before = per_call_ms(lambda: raw(ids, pos), iters=iters)
    runner(ids, pos)  # capture + parity check
    ours = per_call_ms(lambda: runner(ids, pos), iters=iters)
    raw_ms = (raw_before + per_call_ms(lambda: raw(ids, pos), iters=iters)) / 2
    equal = torch.equal(runner(ids, pos), raw(ids, pos).clone())
    captured = [e.capture_ms for e in runner.entries() if e.rows == batch]
    if not captured:  # no graph of this batch: say why rather than time eager as a replay
        raise RuntimeError(f"batch {batch} was not captured: {runner.stats()['fallbacks']}")
    capture_ms = max(captured)
    del graph
    return dict(
        batch=batch,
        eager_ms=eager,
        raw_graph_ms=raw_ms,
        graphguard_ms=ours,
        vs_raw=ours / raw_ms,
        speedup_vs_eager=eager / ours,
        capture_ms=capture_ms,
        bitwise_equal_to_raw=equal,
    )


def small_mlp(blocks: int, device: torch.device):
    weights = [
        torch.randn(1024, 1024, device=device, dtype=torch.bfloat16) / 32 for _ in range(blocks)
    ]

    def step(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = torch.relu(x @ w)
        return x

    return step


def raw_single(step, x: torch.Tensor):
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)

    def call(new_x: torch.Tensor) -> torch.Tensor:
        static_x.copy_(new_x)
        graph.replay()
        return static_out

    return call, graph


def measure_small(blocks: int, iters: int) -> dict:
    """GraphRunner against a raw graph of the same step, interleaved in one process."""
    device = torch.device("cuda")
    step = small_mlp(blocks, device)
    x = torch.randn(1, 1024, device=device, dtype=torch.bfloat16)
    raw, graph = raw_single(step, x)
    runner = gg.GraphRunner(
        step, admission=gg.AdmissionConfig(min_hits=1), capture=gg.CaptureConfig(copy_outputs=False)
    )
    runner(x)  # capture + parity check
    raws, ours = [], []
    for _ in range(3):  # interleaved, so drift of the host hits both alike
        raws.append(per_call_ms(lambda: raw(x), iters=iters))
        ours.append(per_call_ms(lambda: runner(x), iters=iters))
    raw_ms, ours_ms = min(raws), min(ours)
    equal = torch.equal(runner(x), raw(x).clone())
    runner.close()
    del graph
    return dict(
        blocks=blocks,
        raw_graph_ms=raw_ms,
        graphguard_ms=ours_ms,
        vs_raw=ours_ms / raw_ms,
        overhead_us=(ours_ms - raw_ms) * 1e3,
        bitwise_equal_to_raw=equal,
    )


def measure(shape: str, iters: int) -> dict:
    device = torch.device("cuda")
    step = DecoderStep(
        SHAPES[shape], max_batch=max(BATCHES), context=512, dtype=torch.bfloat16, device=device
    )
    runner = gg.GraphRunner(
        step,
        buckets=gg.Buckets(batch=BATCHES),
        admission=gg.AdmissionConfig(min_hits=1),
        capture=gg.CaptureConfig(copy_outputs=False),
    )
    rows = [measure_batch(step, runner, batch, iters) for batch in BATCHES]
    stats = runner.stats()
    runner.close()
    small = [measure_small(blocks, iters=max(200, 4 * iters)) for blocks in (48, 1)]
    return dict(
        shape=shape,
        context=512,
        dtype="bfloat16",
        rows=rows,
        small_rows=small,
        resident_bytes=stats["resident_bytes"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    result = measure(args.shape, args.iters)
    path = write_json("replay_overhead.json", result)
    print(f"replay_overhead ({args.shape}, bf16, ctx 512) -> {path}")
    head = ("batch", "eager ms", "raw ms", "gg ms", "gg/raw", "x eager", "capture ms")
    print(" ".join(f"{h:>10}" for h in head))
    for r in result["rows"]:
        cells = (
            r["batch"],
            r["eager_ms"],
            r["raw_graph_ms"],
            r["graphguard_ms"],
            r["vs_raw"],
            r["speedup_vs_eager"],
            r["capture_ms"],
        )
        print(" ".join(f"{c:>10.3f}" if isinstance(c, float) else f"{c:>10}" for c in cells))
    print("small graphs, batch 1 (MLP blocks of 1024):")
    print(" ".join(f"{h:>10}" for h in ("blocks", "raw ms", "gg ms", "gg/raw", "+us/call")))
    for r in result["small_rows"]:
        small = (r["blocks"], r["raw_graph_ms"], r["graphguard_ms"], r["vs_raw"], r["overhead_us"])
        print(" ".join(f"{c:>10.3f}" if isinstance(c, float) else f"{c:>10}" for c in small))


if __name__ == "__main__":
    main()
