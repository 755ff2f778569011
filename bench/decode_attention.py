"""The paged decode attention kernel alone at long contexts, under split rules side by side.

Device time of `triton_decode.decode_attention` (one layer) captured as a raw CUDA graph, for
the Qwen3-0.6B / Llama-3.1-8B attention shape (16 or 32 query heads over 8 KV heads, head_dim
128, bf16), every row `--contexts` tokens long in 16-token blocks, its table as wide as the
engine pads it (engine/shapes.py `width_bucket`: 8k tokens in 16k slots); the effective
bandwidth is the K/V bytes read over that time, against the H200's 4.25 TB/s. The rules: the
engine's (graphguard/kernels/decode_plan.py SPLIT_RULE) and variations of one knob each, so
that a GPU run says which way to move it.

    python bench/decode_attention.py [--contexts 8192,32768] [--batches 1,16] [--q-heads 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import graph_replay_ms, write_json  # noqa: E402
from graphguard.engine.shapes import width_bucket  # noqa: E402
from graphguard.kernels import triton_decode  # noqa: E402
from graphguard.kernels.decode_plan import SPLIT_RULE, SplitRule  # noqa: E402

HBM_BYTES_PER_S = 4.25e12
KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
RULES = {
    "engine": SPLIT_RULE,
    "256 programs a row": dataclasses.replace(SPLIT_RULE, row_programs=256),
    "1,024 a row, splits of 128+": dataclasses.replace(
        SPLIT_RULE, row_programs=1024, max_splits=128, min_split_tokens=128
    ),
    "tiles of 32": dataclasses.replace(SPLIT_RULE, block_n=32),
    "tiles of 128, 8 warps": dataclasses.replace(SPLIT_RULE, block_n=128, num_warps=8),
    "3 stages": dataclasses.replace(SPLIT_RULE, num_stages=3),
    "8 warps": dataclasses.replace(SPLIT_RULE, num_warps=8),
}


def inputs(batch: int, context: int, q_heads: int) -> tuple:
    """q, the K/V cache, shuffled block tables (as wide as the engine pads them) and lengths
    of `batch` rows of `context` tokens."""
    width = width_bucket(-(-(context + 1) // BLOCK_SIZE))
    shape = (batch * width + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    order = torch.randperm(batch * width, device="cuda") + 1
    tables = order.view(batch, width).to(torch.int32)
    q = torch.randn(batch, q_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, cache, tables, lens


def measure(batch: int, context: int, q_heads: int) -> list[dict]:
    q, cache, tables, lens = inputs(batch, context, q_heads)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    rows = []
    for name, rule in RULES.items():
        plan = rule.plan(tables.shape[1] * BLOCK_SIZE, KV_HEADS)

        def step(rule: SplitRule = rule) -> torch.Tensor:
            return triton_decode.decode_attention(q, cache, tables, lens, 0.088, rule=rule)

        ms = graph_replay_ms(step)
        fraction = kv_bytes / (ms * 1e-3) / HBM_BYTES_PER_S
        rows.append(dict(rule=name, batch=batch, context=context, q_heads=q_heads, us=1e3 * ms,
                         fraction=fraction, plan=plan._asdict()))  # fmt: skip
        print(f"  B{batch:>3} {context:>6} {name:>22}: {1e3 * ms:8.1f} us, "
              f"{100 * fraction:5.1f}% of HBM, {plan}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--q-heads", type=int, default=16, help="16: Qwen3-0.6B, 32: Llama 8B")
    args = parser.parse_args()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            rows += measure(batch, context, args.q_heads)
    path = write_json("decode_attention.json", dict(rows=rows))
    print(f"decode attention, one layer, {args.q_heads}/{KV_HEADS} heads, bf16 -> {path}")
    for r in rows:
        print(f"  B{r['batch']:>3} {r['context']:>6} {r['rule']:>22}: {r['us']:8.1f} us "
              f"({100 * r['fraction']:5.1f}% of {HBM_BYTES_PER_S / 1e12:.2f} TB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
