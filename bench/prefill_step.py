"""Prefill step time with many short prompts: run as rows (each token a row of decode
attention, one whole graph per key) vs grouped attention (masked SDPA per group of similar
prompts, segmented graphs).

SmolLM2-135M shape, random weights, the engine with graphs on and off. Each wave adds N prompts
of L tokens at once and runs to the end; the first step of a wave is the prefill step. Three
untimed waves come first (prefill keys are admitted on their second sighting), then the median
of five timed waves. `grouped` turns rows off for the kernel set, which is how short prefills
ran before rows existed; a prefill of more than 512 tokens is grouped either way.

    python bench/prefill_step.py [--waves 16x10,32x12,1x160] [--device cuda]
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

from bench.decode import NumberTokenizer  # noqa: E402
from bench.timing import write_json  # noqa: E402
from graphguard.core.admission import AdmissionConfig  # noqa: E402
from graphguard.engine.config import PRESETS, GraphConfig, engine_config  # noqa: E402
from graphguard.engine.engine import LLMEngine  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.loader import LoadedModel  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402

WARMUP_WAVES, TIMED_WAVES = 3, 5


@contextmanager
def grouped_attention(loaded: LoadedModel) -> Iterator[None]:
    """Run no prefill as rows: the kernel set's row area 0 for the while."""
    kernels = loaded.model.kernels
    kernels.row_prefill_area = 0
    try:
        yield
    finally:
        del kernels.row_prefill_area  # the set's own again


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
        # keys captured on their second sighting, whatever a capture costs (no payback)
        graphs=GraphConfig(prefill_admission=AdmissionConfig(min_hits=2)),
    )
    engine = LLMEngine(config, loaded)
    rows = []
    try:
        for num_seqs, length in waves:
            for mode in ("rows", "grouped"):
                times = []
                with grouped_attention(loaded) if mode == "grouped" else _nothing():
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
    parser.add_argument("--waves", default="16x10,32x12,1x160", help="NxL prompts per wave")
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
    print(f"{'graphs':>8} {'prompts':>9} {'rows ms':>8} {'grouped ms':>11} {'speedup':>8}")
    for as_rows, grouped in zip(rows[::2], rows[1::2], strict=True):
        shape = f"{as_rows['num_seqs']}x{as_rows['length']}"
        ratio = grouped["prefill_step_ms"] / as_rows["prefill_step_ms"]
        print(
            f"{'on' if as_rows['graphs'] else 'off':>8} {shape:>9} "
            f"{as_rows['prefill_step_ms']:>8.1f} {grouped['prefill_step_ms']:>11.1f} {ratio:>8.2f}"
        )


if __name__ == "__main__":
    main()
