"""The decode step's GEMMs of 1-16 rows (`triton_linear.few_rows_linear`) under plans side by
side: device time per call and the fraction of the weight-read floor.

Each of a model shape's four decode GEMMs (q/k/v, o_proj, gate/up, down_proj) runs over one
weight per layer (distinct weights, so each call reads its weight from HBM as a decode step
does, not from L2), as a raw CUDA graph of all the layers' calls; the time is the replay's
over the layers. Plans: `plan_linear`'s (the engine's from 2 rows on), the kernel before K
was split (tiles of 128, 3 stages), and with `--grid` every combination of splits, tile, warps
and stages; at one row, also `one_row_linear` (the engine's GEMM for a batch of one).

`--prologues` times, for each GEMM a norm or SiLU feeds (q/k/v and gate/up after the residual
add and RMSNorm, down after SiLU-and-multiply), the GEMM alone, the two kernels the engine
launches (the norm or SiLU, then the GEMM) and the one GEMM that computes its input itself
(GRAPHGUARD_GEMM_PROLOGUES=1, docs/kernels.md), each the same way: which prologue is slow,
and by how much against the two launches it replaces.

    python bench/few_rows_linear.py [--shape qwen3-0.6b] [--rows 1,16] [--grid] [--prologues]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import graph_replay_ms, write_json  # noqa: E402
from graphguard.kernels import triton_linear, triton_mlp, triton_norm  # noqa: E402
from graphguard.kernels.triton_linear import LinearPlan  # noqa: E402

HBM_BYTES_PER_S = 4.25e12
# (hidden, q heads x head_dim, kv heads x head_dim, intermediate, layers)
SHAPES = {
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
    "llama-3.1-8b": (4096, 4096, 1024, 14336, 8),  # 8 of 32 layers: 3.5 GB, far past L2
}
BEFORE = LinearPlan(splits=1, block_k=128, num_warps=4, num_stages=3)


def gemms(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (out features, in features) of a layer's decode GEMMs."""
    hidden, q_dim, kv_dim, inter, _ = SHAPES[shape]
    return {
        "qkv": (q_dim + 2 * kv_dim, hidden),
        "o_proj": (hidden, q_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def plans(num_in: int, num_out: int, grid: bool) -> dict[str, LinearPlan]:
    found = {
        "engine": triton_linear.plan_linear(num_in, num_out),
        "split": triton_linear.plan_linear(num_in, num_out, split=True),
        "before": BEFORE,
    }
    if not grid:
        return found
    knobs = itertools.product((1, 2, 4, 8), (128, 256, 512), ((4, 3), (4, 5), (8, 4)))
    for splits, block_k, (warps, stages) in knobs:
        if splits > 1 and num_in % (splits * block_k):
            continue
        found[f"k{splits} t{block_k} w{warps} s{stages}"] = LinearPlan(
            splits, block_k, warps, stages
        )
    return found


def layer_weights(num_out: int, num_in: int, layers: int) -> list[torch.Tensor]:
    """One weight per layer, distinct, so each call reads its weight from HBM."""
    return [
        torch.randn(num_out, num_in, device="cuda", dtype=torch.bfloat16) / num_in**0.5
        for _ in range(layers)
    ]


def _gemms(x: torch.Tensor, weights: list[torch.Tensor], plan: LinearPlan | None = None) -> None:
    for weight in weights:
        triton_linear.few_rows_linear(x, weight, plan)


def _one_row_gemms(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for weight in weights:
        triton_linear.one_row_linear(x, weight)


def measure(shape: str, rows: int, grid: bool) -> list[dict]:
    layers = SHAPES[shape][-1]
    results: list[dict] = []
    for name, (num_out, num_in) in gemms(shape).items():
        weights = layer_weights(num_out, num_in, layers)
        x = torch.randn(rows, num_in, device="cuda", dtype=torch.bfloat16)
        floor_us = 1e6 * num_out * num_in * 2 / HBM_BYTES_PER_S
        for label, plan in plans(num_in, num_out, grid).items():
            step = functools.partial(_gemms, x, weights, plan)
            try:
                us = 1e3 * graph_replay_ms(step, replays=30) / layers
            except Exception as exc:  # noqa: BLE001 - a tile set past the shared memory, say
                print(f"  {name:>8} x{rows:<2} {label:>18}: {type(exc).__name__}", flush=True)
                continue
            results.append(dict(shape=shape, gemm=name, rows=rows, plan=label, us=us,
                                fraction=floor_us / us, knobs=plan._asdict()))  # fmt: skip
        if rows == 1:
            step = functools.partial(_one_row_gemms, x, weights)
            us = 1e3 * graph_replay_ms(step, replays=30) / layers
            results.append(dict(shape=shape, gemm=name, rows=rows, plan="one_row", us=us,
                                fraction=floor_us / us, knobs={}))  # fmt: skip
        del weights
        best = min((r for r in results if r["gemm"] == name and r["rows"] == rows),
                   key=lambda r: r["us"])  # fmt: skip
        engine = next(r for r in results if r["gemm"] == name and r["rows"] == rows
                      and r["plan"] == "engine")  # fmt: skip
        before = next(r for r in results if r["gemm"] == name and r["rows"] == rows
                      and r["plan"] == "before")  # fmt: skip
        one = next((r for r in results if r["gemm"] == name and r["rows"] == rows
                    and r["plan"] == "one_row"), None)  # fmt: skip
        one_row = f"one row {one['us']:5.1f} ({100 * one['fraction']:3.0f}%), " if one else ""
        print(f"  {shape} {name:>8} ({num_out}x{num_in}) x{rows:<2}: floor {floor_us:5.1f} us; "
              f"engine {engine['us']:5.1f} ({100 * engine['fraction']:3.0f}%), "
              f"before {before['us']:5.1f} ({100 * before['fraction']:3.0f}%), {one_row}"
              f"best {best['plan']} {best['us']:5.1f} ({100 * best['fraction']:3.0f}%)",
              flush=True)  # fmt: skip
    return results


def _silu_then_gemm(gate_up: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for weight in weights:
        triton_linear.few_rows_linear(triton_mlp.silu_mul(gate_up), weight)


def _silu_gemm(gate_up: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for weight in weights:
        triton_linear.few_rows_silu_linear(gate_up, weight)


def _norm_then_gemm(x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                    weights: list[torch.Tensor]) -> None:  # fmt: skip
    for weight in weights:
        normed, _ = triton_norm.add_rms_norm(x, residual, gamma, 1e-6)
        triton_linear.few_rows_linear(normed, weight)


def _norm_gemm(x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
               weights: list[torch.Tensor]) -> None:  # fmt: skip
    for weight in weights:
        triton_linear.few_rows_norm_linear(x, residual, gamma, 1e-6, weight)


def measure_prologues(shape: str, rows: int) -> list[dict]:
    """Per layer, us: each prologue GEMM alone, as the engine's two launches, and as one."""
    hidden, layers = SHAPES[shape][0], SHAPES[shape][-1]
    results: list[dict] = []
    shapes = gemms(shape)
    for name in ("qkv", "gate_up", "down"):
        num_out, num_in = shapes[name]
        weights = layer_weights(num_out, num_in, layers)
        x = torch.randn(rows, num_in, device="cuda", dtype=torch.bfloat16)
        if name == "down":
            gate_up = torch.randn(rows, 2 * num_in, device="cuda", dtype=torch.bfloat16)
            two = functools.partial(_silu_then_gemm, gate_up, weights)
            one = functools.partial(_silu_gemm, gate_up, weights)
        else:
            residual = torch.randn_like(x)
            gamma = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
            two = functools.partial(_norm_then_gemm, x, residual, gamma, weights)
            one = functools.partial(_norm_gemm, x, residual, gamma, weights)
        row: dict = dict(shape=shape, gemm=name, rows=rows)
        steps = (("alone", functools.partial(_gemms, x, weights)), ("two launches", two),
                 ("prologue", one))  # fmt: skip
        for label, step in steps:
            row[label] = 1e3 * graph_replay_ms(step, replays=30) / layers
        results.append(row)
        print(f"  {shape} {name:>8} x{rows:<2}: GEMM alone {row['alone']:5.1f} us, two launches "
              f"{row['two launches']:5.1f}, prologue {row['prologue']:5.1f} "
              f"({row['prologue'] / row['two launches']:.2f}x the two)", flush=True)  # fmt: skip
        del weights
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--grid", action="store_true", help="every combination of the knobs")
    parser.add_argument("--prologues", action="store_true", help="the GEMMs with their inputs' "
                        "norm or SiLU: two launches against one")  # fmt: skip
    args = parser.parse_args()
    if args.prologues:
        found = [r for n in args.rows.split(",") for r in measure_prologues(args.shape, int(n))]
        print(f"-> {write_json(f'few_rows_prologues_{args.shape}.json', dict(results=found))}")
        return
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results += measure(args.shape, rows, args.grid)
    path = write_json(f"few_rows_linear_{args.shape}.json", dict(results=results))
    for rows in sorted({r["rows"] for r in results}):
        total = {label: sum(r["us"] for r in results if r["rows"] == rows and r["plan"] == label)
                 for label in ("engine", "before")}  # fmt: skip
        print(f"{args.shape} x{rows}: a layer's four GEMMs {total['engine']:.1f} us "
              f"(before: {total['before']:.1f})")  # fmt: skip
    print(f"-> {path}")


if __name__ == "__main__":
    main()
