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


def cycle(
    step, device, budget_graphs: int | None, trials: int, keys: range, sync_calls=False, copy=True
) -> str:
    runner = gg.GraphRunner(step, admission=NAIVE, max_bytes=1 << 40)
    runner(*step_inputs(max(keys), 512, device, vocab=step.shape.vocab))
    one = runner.stats()["resident_bytes"]
    runner.close()
    budget = (budget_graphs or 1000) * one
    runner = gg.GraphRunner(step, admission=NAIVE, max_bytes=budget, copy_outputs=copy)
    wrong = 0
    for t in range(trials):
        for b in keys:
            args = step_inputs(b, 512, device, seed=t * 100 + b, vocab=step.shape.vocab)
            if sync_calls:
                torch.cuda.synchronize()
            out = runner(*args).clone()
            wrong += not torch.equal(out, step(*args))
    stats = runner.stats()
    runner.close()
    return (
        f"budget={budget_graphs} captures={stats['captures']} evictions={stats['evictions']} "
        f"mismatches={stats['parity_mismatches']} replays={stats['replays']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device = torch.device("cuda")
    step = DecoderStep(
        SHAPES["qwen3-0.6b"], max_batch=32, context=512, dtype=torch.bfloat16, device=device
    )
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset")
    same = sum(
        torch.equal(
            step(*step_inputs(b, 512, device, seed=b, vocab=151936)),
            step(*step_inputs(b, 512, device, seed=b, vocab=151936)),
        )
        for b in range(1, 9)
    )
    print(f"probe[{config}] eager twice equal: {same}/8")
    print(f"probe[{config}] no eviction: {cycle(step, device, None, args.trials, range(1, 9))}")
    print(f"probe[{config}] budget 3: {cycle(step, device, 3, args.trials, range(1, 9))}")
    late = sum(
        torch.equal(
            step(*step_inputs(b, 512, device, seed=b, vocab=151936)),
            step(*step_inputs(b, 512, device, seed=b, vocab=151936)),
        )
        for b in range(1, 9)
    )
    print(f"probe[{config}] eager twice equal after churn: {late}/8")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                result = cycle(step, device, 3, args.trials, range(1, 9))
        except RuntimeError as exc:
            result = f"unavailable ({str(exc)[:60]})"
        print(f"probe[{config}] budget 3 sdpa={backend.name}: {result}")


if __name__ == "__main__":
    main()
