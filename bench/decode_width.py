"""What a wide block-table bucket costs a decode step: batch 32 with 512-token contexts, the
decode step captured as a raw CUDA graph with its block tables padded to 512 tokens (32 blocks)
and to 4,096 tokens (256 blocks), side by side, for the fused (triton) and the reference
(torch) kernels. The fused decode attention reads each sequence's real context only, so the wide
bucket should cost about the same (target: at most 1.2x); the reference attention gathers the
padded width. Device time, median of 50 replays.

    python bench/decode_width.py [--shapes smollm2-135m,qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import graph_replay_ms, write_json  # noqa: E402
from graphguard.engine.config import PRESETS  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.forward import EagerForward  # noqa: E402
from graphguard.engine.scheduling.kv import PagedKVStorage  # noqa: E402
from graphguard.kernels import select_kernels  # noqa: E402

BATCH, CONTEXT, BLOCK_SIZE = 32, 512, 16
WIDTHS = (CONTEXT // BLOCK_SIZE, 4096 // BLOCK_SIZE)  # blocks: the exact bucket and a wide one


def replay_ms(forward: EagerForward, width: int) -> float:
    """Device time of one decode step at BATCH rows of CONTEXT tokens, block tables `width`
    wide (each row's real blocks first, then the dummy block), median of 50 graph replays."""
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    tables = torch.full((BATCH, width), PagedKVStorage.DUMMY_BLOCK, dtype=torch.int32)
    for row in range(BATCH):
        start = 1 + row * blocks_per_seq  # past the dummy block
        tables[row, :blocks_per_seq] = torch.arange(start, start + blocks_per_seq)
    tables = tables.cuda()
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device="cuda")
    ids = torch.zeros(BATCH, dtype=torch.int64, device="cuda")
    positions = (lens - 1).long()
    # every row writes the dummy block's first slot (timing only: no row reads it)
    slots = torch.full((BATCH,), PagedKVStorage.DUMMY_BLOCK * BLOCK_SIZE, device="cuda")
    return graph_replay_ms(forward.decode, ids, positions, tables, lens, slots)


def measure(shape: str) -> list[dict]:
    config = PRESETS[shape]
    model = build_model(config, dtype=torch.bfloat16, device="cuda", seed=0)
    kv = PagedKVStorage(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_blocks=1 + BATCH * CONTEXT // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    rows = []
    for kernels in ("triton", "torch"):
        model.use_kernels(select_kernels(kernels, torch.device("cuda"), torch.bfloat16).kernels)
        forward = EagerForward(model, kv)
        exact, wide = (replay_ms(forward, width) for width in WIDTHS)
        rows.append(
            dict(shape=shape, kernels=kernels, exact_ms=exact, wide_ms=wide, ratio=wide / exact)
        )
        print(
            f"  {shape} {kernels}: batch {BATCH}, context {CONTEXT}: {WIDTHS[0]} blocks "
            f"{exact:.3f} ms, {WIDTHS[1]} blocks {wide:.3f} ms ({wide / exact:.2f}x)",
            flush=True,
        )
    del model, kv
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2-135m,qwen3-0.6b")
    args = parser.parse_args()
    rows = [row for shape in args.shapes.split(",") for row in measure(shape)]
    path = write_json("decode_width.json", dict(batch=BATCH, context=CONTEXT, rows=rows))
    print(f"decode step, wide block-table bucket vs exact (target fused <= 1.2x) -> {path}")
    print(f"{'shape':>13} {'kernels':>7} {'exact ms':>8} {'wide ms':>8} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['shape']:>13} {r['kernels']:>7} {r['exact_ms']:>8.3f} {r['wide_ms']:>8.3f} "
            f"{r['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
