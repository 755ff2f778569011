"""Prefill step time with many prompts: grouped attention vs one attention call per sequence.

SmolLM2-135M shape, random weights, the engine with graphs on (segmented prefill) and off. Each
wave adds N prompts of L tokens at once and runs to the end; the first step of a wave is the
prefill step. Three untimed waves come first (prefill keys are admitted on their second
sighting), then the median of five timed waves. `per-sequence` plans no prefill groups, which
is how prefill attention ran before groups existed.

    python bench/prefill_step.py [--waves 16x10,1x160,32x20] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphguard.engine.model_runner as model_runner  # noqa: E402
from bench.decode import NumberTokenizer  # noqa: E402
from bench.timing import write_json  # noqa: E402
from graphguard.engine.attention import per_sequence_groups  # noqa: E402
from graphguard.engine.config import PRESETS, engine_config  # noqa: E402
from graphguard.engine.engine import LLMEngine  # noqa: E402
from graphguard.engine.loader import LoadedModel  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.sampling import SamplingParams  # noqa: E402

WARMUP_WAVES, TIMED_WAVES = 3, 5


@contextmanager
def per_sequence_attention() -> Iterator[None]:
    """Plan a group per sequence: every sequence gets its own attention call per layer."""
    planned = model_runner.plan_prefill_groups
    model_runner.plan_prefill_groups = per_sequence_groups
    try:
        yield
    finally:
        model_runner.plan_prefill_groups = planned


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_ms(engine: LLMEngine, num_seqs: int, length: int, wave: int) -> float:
    """Add num_seqs prompts, time the first (prefill) step, then finish the wave."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [100 + (i * 7 + j) % 1000 for j in range(length)]
        engine.add_request(f"w{wave}-{i}", prompt, params)
    sync(engine.device)
    start = time.perf_counter()
    engine.step()
    sync(engine.device)
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds * 1000


def measure(loaded: LoadedModel, device: str, eager: bool, waves: list[tuple[int, int]]):
    longest = max(n * length for n, length in waves)
    config = engine_config(
        device=device,
        enforce_eager=eager,
        max_num_seqs=max(n for n, _ in waves),
        max_model_len=max(length for _, length in waves) + 16,
        max_num_batched_tokens=max(longest, 2048),
    )
    engine = LLMEngine(config, loaded)
    rows = []
    try:
        for num_seqs, length in waves:
            for mode in ("grouped", "per-sequence"):
                times = []
                with per_sequence_attention() if mode == "per-sequence" else _nothing():
                    for wave in range(WARMUP_WAVES + TIMED_WAVES):
                        ms = prefill_ms(engine, num_seqs, length, wave)
                        if wave >= WARMUP_WAVES:
                            times.append(ms)
                rows.append(
                    dict(
                        graphs=not eager,
                        num_seqs=num_seqs,
                        length=length,
                        mode=mode,
                        prefill_step_ms=statistics.median(times),
                    )
                )
    finally:
        engine.shutdown()
    return rows


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", default="16x10,32x20,1x160", help="NxL prompts per wave")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    waves = [tuple(int(x) for x in w.split("x")) for w in args.waves.split(",")]
    config = PRESETS["smollm2-135m"]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(config, dtype=dtype, device=args.device, seed=0)
    loaded = LoadedModel("smollm2-135m", model, config, NumberTokenizer(config))  # type: ignore[arg-type]
    rows = []
    for eager in (False, True):
        if eager is False and not args.device.startswith("cuda"):
            continue  # graphs need CUDA
        rows += measure(loaded, args.device, eager, waves)  # type: ignore[arg-type]
    path = write_json("prefill_step.json", {"benchmark": "prefill_step", "rows": rows})
    print(f"prefill_step (smollm2-135m, {args.device}) -> {path}")
    print(f"{'graphs':>8} {'prompts':>9} {'grouped ms':>11} {'per-seq ms':>11} {'speedup':>8}")
    for grouped, single in zip(rows[::2], rows[1::2], strict=True):
        shape = f"{grouped['num_seqs']}x{grouped['length']}"
        ratio = single["prefill_step_ms"] / grouped["prefill_step_ms"]
        print(
            f"{'on' if grouped['graphs'] else 'off':>8} {shape:>9} "
            f"{grouped['prefill_step_ms']:>11.1f} {single['prefill_step_ms']:>11.1f} {ratio:>8.2f}"
        )


if __name__ == "__main__":
    main()
