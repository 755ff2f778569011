"""Where do captured decoder steps differ bitwise from eager? (diagnostic)

python tools/parity_probe.py [--trials 10]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphguard as gg  # noqa: E402
from bench.decoder_step import SHAPES, DecoderStep, step_inputs  # noqa: E402

NAIVE = gg.AdmissionConfig(
    min_hits=1, frequency_aware=False, max_capture_fraction=1.0, max_recaptures=1 << 30
)


def cycle(step: DecoderStep, device: torch.device, budget_graphs: int | None, trials: int) -> str:
    """Cycle batch sizes 1-8 through one runner; count the graphs exact parity rejected."""
    keys = range(1, 9)
    runner = gg.GraphRunner(step, admission=NAIVE, max_bytes=1 << 40)
    runner(*step_inputs(max(keys), 512, device, vocab=step.shape.vocab))
    one = runner.stats()["resident_bytes"]
    runner.close()
    budget = (budget_graphs or 1000) * one
    runner = gg.GraphRunner(step, admission=NAIVE, max_bytes=budget)
    for t in range(trials):
        for b in keys:
            runner(*step_inputs(b, 512, device, seed=t * 100 + b, vocab=step.shape.vocab))
    stats = runner.stats()
    runner.close()
    return (
        f"budget={budget_graphs} captures={stats['captures']} evictions={stats['evictions']} "
        f"mismatches={stats['parity_mismatches']} replays={stats['replays']}"
    )


def eager_twice_equal(step: DecoderStep, device: torch.device) -> int:
    vocab = step.shape.vocab
    return sum(
        torch.equal(
            step(*step_inputs(b, 512, device, seed=b, vocab=vocab)),
            step(*step_inputs(b, 512, device, seed=b, vocab=vocab)),
        )
        for b in range(1, 9)
    )


def side_stream_differs(step: DecoderStep, device: torch.device, trials: int) -> int:
    side, differs = torch.cuda.Stream(), 0
    for trial in range(trials):
        args = step_inputs(4, 512, device, seed=trial, vocab=step.shape.vocab)
        ref = step(*args)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other = step(*args)
        torch.cuda.current_stream().wait_stream(side)
        differs += not torch.equal(ref, other)
    return differs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device = torch.device("cuda")
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset")
    for attention in ("default", "math"):
        step = DecoderStep(
            SHAPES["qwen3-0.6b"],
            max_batch=32,
            context=512,
            dtype=torch.bfloat16,
            device=device,
            attention=attention,
        )
        tag = f"probe[cublas={config} sdpa={attention}]"
        print(f"{tag} eager twice equal: {eager_twice_equal(step, device)}/8")
        print(f"{tag} side-stream eager differs: {side_stream_differs(step, device, 10)}/10")
        print(f"{tag} no eviction: {cycle(step, device, None, args.trials)}")
        print(f"{tag} budget 3: {cycle(step, device, 3, args.trials)}")


if __name__ == "__main__":
    main()
