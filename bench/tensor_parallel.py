"""Tensor parallelism 2 against 1: Qwen3-0.6B shapes, random bf16 weights, batch 1 and 32, graphs
on and off, side by side in one run (two GPUs).

Each world size runs one engine (tensor-parallel 2: rank 0 here, rank 1 a child process); graphs
are turned off for the second half of a run through rank 0's kill switch, which travels with
every step to the other rank. Every configuration runs twice untimed (captures happen there),
then timed: 128 new tokens per request after 16-token prompts.

    python bench/tensor_parallel.py [--batches 1,32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the same kernels on every stream
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode import NumberTokenizer, run_requests  # noqa: E402
from bench.timing import out_dir, write_json  # noqa: E402
from graphguard.core.switch import KILL_SWITCH_ENV  # noqa: E402
from graphguard.engine.config import PRESETS, engine_config  # noqa: E402
from graphguard.engine.engine import LLMEngine  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.loader import LoadedModel  # noqa: E402

SHAPE, PROMPT_LEN, NEW_TOKENS = "qwen3-0.6b", 16, 128


def random_whole() -> LoadedModel:
    """The whole model with seeded random weights on the CPU: every rank builds the same."""
    config = PRESETS[SHAPE]
    model = build_model(config, dtype=torch.bfloat16, device="cpu", seed=0)
    return LoadedModel(SHAPE, model, config, NumberTokenizer(config))  # type: ignore[arg-type]


def tok_s(engine: LLMEngine, batch: int) -> tuple[float, float]:
    """Tokens per second and milliseconds per step at `batch`, after two untimed runs."""
    for _ in range(2):
        run_requests(engine, batch, max_tokens=NEW_TOKENS)
    steps = engine.stats()["num_steps"]
    start = time.perf_counter()
    run_requests(engine, batch, max_tokens=NEW_TOKENS)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return batch * NEW_TOKENS / seconds, 1e3 * seconds / (engine.stats()["num_steps"] - steps)


def measure(world_size: int, batches: list[int]) -> list[dict]:
    from graphguard.engine.launch.spawn import start_ranks

    config = engine_config(
        tensor_parallel_size=world_size,
        kernels="triton",
        max_num_seqs=max(batches),
        max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
        max_num_batched_tokens=max(batches) * PROMPT_LEN,
        num_kv_blocks=max(batches) * 10 + 1,
        max_graph_bytes=8 << 30,
    )
    followers = None
    if world_size == 1:
        whole = random_whole()
        model = whole.model.to("cuda")
        engine = LLMEngine(config, LoadedModel(SHAPE, model, whole.config, whole.tokenizer))
    else:
        engine, followers = start_ranks(config, load_whole=random_whole)
    rows = []
    for graphs in (True, False):
        os.environ[KILL_SWITCH_ENV] = "0" if graphs else "1"  # rank 0's switch: every rank's
        for batch in batches:
            rate, step_ms = tok_s(engine, batch)
            rows.append(
                dict(tp=world_size, batch=batch, graphs=graphs, tok_s=rate, ms_per_step=step_ms)
            )
            print(rows[-1], flush=True)
    os.environ.pop(KILL_SWITCH_ENV)
    engine.shutdown()
    if followers is not None:
        followers.join(30.0)
        torch.distributed.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = measure(1, batches) + measure(2, batches)
    path = write_json("tensor_parallel.json", {"shape": SHAPE, "rows": rows})
    print(f"wrote {path} (in {out_dir()})")


if __name__ == "__main__":
    main()
