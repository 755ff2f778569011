"""The paged decode attention kernel alone at long contexts, under split rules side by side.

Device time of `triton_decode.decode_attention` (one layer) captured as a raw CUDA graph, for
the Qwen3-0.6B / Llama-3.1-8B attention shape (16 or 32 query heads over 8 KV heads, head_dim
128, bf16), every row `--contexts` tokens long in 16-token blocks, its table as wide as the
engine pads it (engine/shapes.py `width_bucket`: 8k tokens in 16k slots); the effective
bandwidth is the K/V bytes read over that time, against the H200's 4.25 TB/s. The rules: the
engine's (graphguard/kernels/decode_plan.py SPLIT_RULE) and variations of one knob each, so
that a GPU run says which way to move it.

    python bench/decode_attention.py [--contexts 8192,32768] [--batches 1,16] [--q-heads 16]
    python bench/decode_attention.py --grid   # every combination of the knobs, best first
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
    "merge, 4 programs a head": dataclasses.replace(SPLIT_RULE, merge_programs=4),
    "merge, 8 programs a head": dataclasses.replace(SPLIT_RULE, merge_programs=8),
    "merge, 8 programs a head, 64 splits a load": dataclasses.replace(
        SPLIT_RULE, merge_programs=8, merge_chunk=64
    ),
}


def grid_rules() -> dict[str, SplitRule]:
    """Every combination of tile, warps, stages and programs a row (splits of at least two
    tiles, at most 256 of them), named by its knobs."""
    rules = {"engine": SPLIT_RULE}
    knobs = itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (256, 512, 1024, 2048))
    for block_n, warps, stages, programs in knobs:
        rule = dataclasses.replace(
            SPLIT_RULE, block_n=block_n, num_warps=warps, num_stages=stages,
            row_programs=programs, max_splits=256, min_split_tokens=2 * block_n,
        )  # fmt: skip
        rules[f"n{block_n} w{warps} s{stages} p{programs}"] = rule
    return rules


def inputs(batch: int, context: int, q_heads: int, padded: int = 0) -> tuple:
    """q, the K/V cache, shuffled block tables (as wide as the engine pads them) and lengths
    of `batch` rows of `context` tokens, then rows up to `padded` as the engine pads a batch
    that rides a larger bucket's graph: length 1 over the dummy block 0."""
    width = width_bucket(-(-(context + 1) // BLOCK_SIZE))
    shape = (batch * width + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    order = torch.randperm(batch * width, device="cuda") + 1
    rows = max(batch, padded)
    tables = torch.zeros((rows, width), dtype=torch.int32, device="cuda")
    tables[:batch] = order.view(batch, width).to(torch.int32)
    q = torch.randn(rows, q_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lens = torch.ones((rows,), dtype=torch.int32, device="cuda")
    lens[:batch] = context
    return q, cache, tables, lens


def measure(
    batch: int, context: int, q_heads: int, rules: dict[str, SplitRule], padded: int = 0
) -> list[dict]:
    q, cache, tables, lens = inputs(batch, context, q_heads, padded)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    rows = []
    for name, rule in rules.items():
        plan = rule.plan(tables.shape[1] * BLOCK_SIZE, KV_HEADS)

        def step(rule: SplitRule = rule) -> torch.Tensor:
            return triton_decode.decode_attention(q, cache, tables, lens, 0.088, rule=rule)

        try:
            ms = graph_replay_ms(step)
        except Exception as exc:  # noqa: BLE001 - a tile set past the shared memory, say
            print(f"  B{batch:>3} {context:>6} {name:>22}: {type(exc).__name__}", flush=True)
            continue
        fraction = kv_bytes / (ms * 1e-3) / HBM_BYTES_PER_S
        rows.append(dict(rule=name, batch=batch, padded=padded, context=context, q_heads=q_heads,
                         us=1e3 * ms, fraction=fraction, plan=plan._asdict()))  # fmt: skip
        print(f"  B{batch:>3}/{padded or batch:<3} {context:>6} {name:>22}: {1e3 * ms:8.1f} us, "
              f"{100 * fraction:5.1f}% of HBM, {plan}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument(
        "--batches", default="1,16", help="rows a launch; 1/16: one real row padded to 16"
    )
    parser.add_argument("--q-heads", type=int, default=16, help="16: Qwen3-0.6B, 32: Llama 8B")
    parser.add_argument("--grid", action="store_true", help="every combination of the knobs")
    args = parser.parse_args()
    rules = grid_rules() if args.grid else RULES
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for spec in args.batches.split(","):
            batch, _, padded = spec.partition("/")
            rows += measure(int(batch), context, args.q_heads, rules, int(padded or 0))
    if args.grid:
        print_grid(rows)
    path = write_json("decode_attention.json", dict(rows=rows))
    print(f"decode attention, one layer, {args.q_heads}/{KV_HEADS} heads, bf16 -> {path}")
    for r in rows:
        rows_ = f"{r['batch']:>3}/{r['padded'] or r['batch']:<3}"
        print(f"  B{rows_} {r['context']:>6} {r['rule']:>22}: {r['us']:8.1f} us "
              f"({100 * r['fraction']:5.1f}% of {HBM_BYTES_PER_S / 1e12:.2f} TB/s)")  # fmt: skip


def print_grid(rows: list[dict]) -> None:
    """The rules by the sum over shapes of their time relative to the best at each shape."""
    best: dict[tuple[int, int, int], float] = {}
    for r in rows:
        shape = (r["batch"], r["padded"], r["context"])
        best[shape] = min(best.get(shape, float("inf")), r["us"])
    score: dict[str, list[float]] = {}
    for r in rows:
        shape = (r["batch"], r["padded"], r["context"])
        score.setdefault(r["rule"], []).append(r["us"] / best[shape])
    complete = {name: ratios for name, ratios in score.items() if len(ratios) == len(best)}
    ranked = sorted(complete.items(), key=lambda item: sum(item[1]))
    shapes = ", ".join(f"B{b}/{p or b} x {c}: {us:.1f} us" for (b, p, c), us in best.items())
    print(f"best at each shape: {shapes}")
    print("rules by time over the best at each shape (1.00: the best), summed:")
    for name, ratios in ranked[:15] + [item for item in ranked if item[0] == "engine"]:
        print(f"  {name:>22}: {sum(ratios):6.2f}  " + " ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
