"""Where a long-context decode step's device time goes: the decode step alone
(`engine.forward.decode`, one row) captured as a raw CUDA graph at 512 / 8k / 30k tokens of
context, then the CUDA kernels of three eager steps at the longest, by total time.

bench/long_context.py measures a 30k-token stream's whole step; bench/decode_attention.py the
attention kernel alone. This one says whether the gap between them is on the device (the
replay's time) or on the host (the step's wall time minus it), and which kernels hold it.

    python bench/long_decode_profile.py [--contexts 512,8192,30000] [--shape qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.long_context import load  # noqa: E402
from bench.timing import graph_replay_ms  # noqa: E402
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.shapes import width_bucket  # noqa: E402

BLOCK_SIZE = 16


def decode_inputs(context: int) -> tuple[torch.Tensor, ...]:
    """One row at `context` tokens over distinct blocks 1.. (block 0 is the dummy), its table
    padded to the engine's width bucket: decode's arguments."""
    blocks = -(-context // BLOCK_SIZE)
    tables = torch.zeros((1, width_bucket(blocks)), dtype=torch.int32, device="cuda")
    tables[0, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32)
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    slots = torch.tensor([blocks * BLOCK_SIZE - 1], device="cuda")
    return ids, (lens - 1).long(), tables, lens, slots


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="512,8192,30000")
    parser.add_argument("--shape", default="qwen3-0.6b")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts)
    llm = LLM(load(args.shape, False), max_model_len=longest + 64, max_num_seqs=1,
              num_kv_blocks=longest // BLOCK_SIZE + 64, batch_buckets=(1,),
              prefix_caching=False)  # fmt: skip
    decode = llm.engine.forward.decode
    for context in contexts:
        replay = graph_replay_ms(decode, *decode_inputs(context))
        print(f"context {context:>6}: decode step alone {replay:.3f} ms", flush=True)
    from torch.profiler import ProfilerActivity, profile

    inputs = decode_inputs(longest)
    decode(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            decode(*inputs)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    print(f"-> kernels of 3 eager steps at {longest} tokens\n{table}")
    llm.shutdown()


if __name__ == "__main__":
    main()
