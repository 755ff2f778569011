"""Prefill attention over the paged cache: the Triton kernel (graphguard/kernels/triton_prefill.py)
against the plain PyTorch path (`paged_prefill_attention`: per-group SDPA, a continued chunk's
context gathered, its mask built, K/V heads repeated), side by side in one run.

Kernel part: one layer's attention of a whole prompt of 512 / 2k / 8k / 32k tokens prefilled in
chunks (each chunk one step over its cached prefix, as the scheduler splits a long prompt),
steps of many fresh prompts packed together, and short chunks after a long cached prefix (a
question after a shared document: the kernel's small grid); Qwen3-0.6B heads (16 query, 8
K/V, dimension 128) by default, bf16, block size 16. Columns: milliseconds for the whole
prompt (the sum of its chunks, each the median of its timed calls), TFLOP/s (causal: each
query's visible keys only) and the kernel's speedup. The `triton` row is the launcher's own
choice of tiles; others can be compared beside it with `--configs 128x64x8x3,16x64x4x3`
(rows x keys x warps x stages).

Engine part: an LLMEngine on random Qwen3-0.6B weights prefills one prompt of 8k and 30k tokens
(max_tokens=1) with the reference kernel set and with the Triton one, at each step token budget
of `--engine-chunks` (the chunk size of a long prompt); prefill tokens per second, the median of
three runs after two untimed ones.

    python bench/prefill_kernel.py [--contexts 512,2048,8192,32768] [--chunk 4096]
        [--batches 16x512,64x128] [--tails 64x30720,1024x30720]
        [--engine-prompts 8192,30000] [--engine-chunks 4096,8192,16384]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode import NumberTokenizer  # noqa: E402
from bench.timing import write_json  # noqa: E402
from graphguard.engine.config import PRESETS, engine_config  # noqa: E402
from graphguard.engine.engine import LLMEngine  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.attention import (  # noqa: E402
    AttentionMetadata,
    paged_prefill_attention,
    plan_prefill_groups,
)
from graphguard.engine.models.loader import LoadedModel  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402
from graphguard.kernels import triton_prefill  # noqa: E402

BLOCK_SIZE, DTYPE = 16, torch.bfloat16
Step = list[tuple[int, int]]  # (cached, new tokens) per sequence


def events_ms(call: Callable[[], Any], repeats: int) -> float:
    """Median device time of `call` over `repeats` timed calls, after two untimed ones."""
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        call()
        ended.record()
        ended.synchronize()
        times.append(began.elapsed_time(ended))
    return statistics.median(times)


def causal_flops(step: Step, num_heads: int, head_dim: int) -> float:
    """Two matrix products over each query's visible keys (cached prefix and itself)."""
    keys = sum(new * cached + new * (new + 1) // 2 for cached, new in step)
    return 4.0 * num_heads * head_dim * keys


class PagedPrompts:
    """A cache holding `num_seqs` sequences of up to `max_len` tokens (random K/V), in shuffled
    blocks, and the metadata of a prefill step over them."""

    def __init__(self, num_seqs: int, max_len: int, num_kv_heads: int, head_dim: int) -> None:
        width = -(-max_len // BLOCK_SIZE)
        num_blocks = num_seqs * width + 1
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.kv_cache = (
            torch.randn(shape, device="cuda", dtype=DTYPE),
            torch.randn(shape, device="cuda", dtype=DTYPE),
        )
        order = torch.randperm(num_blocks - 1, device="cuda") + 1
        self.tables = order.view(num_seqs, width).to(torch.int32)

    def meta(self, step: Step, groups: bool) -> AttentionMetadata:
        """Metadata of one step (sequence i: row i of the tables), groups planned if asked."""
        tables = self.tables.tolist()
        slots = [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for table, (cached, new) in zip(tables, step, strict=False)
            for p in range(cached, cached + new)
        ]
        seq_lens, query_lens = [c + n for c, n in step], [n for _, n in step]
        starts = torch.tensor([0, *query_lens]).cumsum(0)
        return AttentionMetadata(
            packed=True,
            slot_mapping=torch.tensor(slots, device="cuda"),
            block_tables=self.tables[: len(step)].contiguous(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            query_start_loc=starts.to(device="cuda", dtype=torch.int32),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
            prefill_groups=plan_prefill_groups(query_lens, seq_lens, "cuda") if groups else None,
        )


def time_step(
    prompts: PagedPrompts, step: Step, heads: tuple[int, int, int], configs: list[Any]
) -> dict[str, float]:
    """Device ms of one step's attention on each path (the SDPA path's groups planned before
    timing, as the model runner plans them once per step for all layers)."""
    num_heads, _, head_dim = heads
    meta = prompts.meta(step, groups=True)
    num_tokens, scale = sum(n for _, n in step), head_dim**-0.5
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", dtype=DTYPE)
    flat = [c.view(-1, *c.shape[2:]) for c in prompts.kv_cache]
    k, v = (c[meta.slot_mapping] for c in flat)
    repeats = 3 if num_tokens * max(c + n for c, n in step) > 1 << 26 else 10

    def sdpa() -> torch.Tensor:
        return paged_prefill_attention(q, k, v, *prompts.kv_cache, meta, scale)

    def kernel(config: triton_prefill.PrefillConfig | None) -> Callable[[], torch.Tensor]:
        return lambda: triton_prefill.prefill_attention(
            q, prompts.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            config,
        )  # fmt: skip

    times = {"sdpa": events_ms(sdpa, repeats)}
    for config in configs:
        name = "triton" if config is None else "triton " + "x".join(map(str, config))
        times[name] = events_ms(kernel(config), repeats)
    return times


def kernel_rows(args: argparse.Namespace, heads: tuple[int, int, int]) -> list[dict[str, Any]]:
    """One row per (case, path): a long prompt in chunks, or a step of many fresh prompts."""
    configs: list[Any] = [None] + [
        triton_prefill.PrefillConfig(*map(int, c.split("x"))) for c in args.configs if c
    ]
    cases: list[tuple[str, list[Step]]] = []
    for context in args.contexts:
        chunks = [(c, min(args.chunk, context - c)) for c in range(0, context, args.chunk)]
        cases.append((f"{context} in {args.chunk}", [[chunk] for chunk in chunks]))
    for num_seqs, length in args.batches:
        cases.append((f"{num_seqs}x{length}", [[(0, length)] * num_seqs]))
    for new, cached in args.tails:
        cases.append((f"{new} after {cached}", [[(cached, new)]]))
    rows = []
    for name, steps in cases:
        longest = max(c + n for step in steps for c, n in step)
        prompts = PagedPrompts(max(len(s) for s in steps), longest, heads[1], heads[2])
        totals: dict[str, float] = {}
        for step in steps:
            for path, ms in time_step(prompts, step, heads, configs).items():
                totals[path] = totals.get(path, 0.0) + ms
        flops = sum(causal_flops(step, heads[0], heads[2]) for step in steps)
        for path, ms in totals.items():
            tflops = flops / ms / 1e9
            rows.append(
                dict(case=name, path=path, ms=ms, tflops=tflops, vs_sdpa=totals["sdpa"] / ms)
            )
        del prompts
        torch.cuda.empty_cache()
    return rows


def prefill_tok_s(engine: LLMEngine, prompt: list[int], runs: int) -> float:
    """Prompt tokens per second of prefilling `prompt` alone (max_tokens=1), the median of
    `runs` timed runs after two untimed ones."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rates = []
    for run in range(2 + runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(f"r{len(prompt)}-{run}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        if run >= 2:
            rates.append(len(prompt) / (time.perf_counter() - start))
    return statistics.median(rates)


def engine_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prefill tok/s of each prompt length, kernel set and chunk size (the reference set at
    the first chunk size only: it is the slow one)."""
    config = PRESETS["qwen3-0.6b"]
    model = build_model(config, dtype=DTYPE, device="cuda", seed=0)
    loaded = LoadedModel("qwen3-0.6b", model, config, NumberTokenizer(config))  # type: ignore[arg-type]
    rows = []
    for kernels in ("torch", "triton"):
        for chunk in args.engine_chunks[:1] if kernels == "torch" else args.engine_chunks:
            rows += engine_rates(loaded, kernels, chunk, args.engine_prompts)
    return rows


def engine_rates(
    loaded: LoadedModel, kernels: str, chunk: int, lengths: list[int]
) -> list[dict[str, Any]]:
    """Prefill tok/s of a prompt of each of `lengths` with `kernels`, chunks of `chunk`."""
    settings = dict(kernels=kernels, max_num_seqs=4, max_num_batched_tokens=chunk)
    config = engine_config(**settings, max_model_len=max(lengths) + 16, prefix_caching=False)
    engine = LLMEngine(config, loaded)
    rows = []
    try:
        for length in lengths:
            prompt = [100 + (j * 7919) % 40000 for j in range(length)]
            rate = prefill_tok_s(engine, prompt, runs=3)
            rows.append(dict(kernels=kernels, chunk=chunk, prompt=length, tok_s=rate))
            print(f"engine {kernels:>6} chunk {chunk:>6} prompt {length:>6}: {rate:>9,.0f} tok/s")
    finally:
        engine.shutdown()
    return rows


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=ints, default=[512, 2048, 8192, 32768])
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per prefill chunk")
    parser.add_argument("--batches", default="16x512,64x128", help="NxL fresh prompts per step")
    parser.add_argument(
        "--tails", default="64x30720,1024x30720", help="NxC: a chunk of N tokens after C cached"
    )
    parser.add_argument("--heads", default="16/8/128", help="query/KV heads/head dim")
    parser.add_argument("--configs", type=lambda s: s.split(","), default=[])
    parser.add_argument("--engine-prompts", type=ints, default=[8192, 30000])
    parser.add_argument("--engine-chunks", type=ints, default=[4096, 8192, 16384])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("prefill_kernel: needs CUDA")
        return 0
    args.batches = [tuple(map(int, b.split("x"))) for b in args.batches.split(",") if b]
    args.tails = [tuple(map(int, t.split("x"))) for t in args.tails.split(",") if t]
    heads = tuple(map(int, args.heads.split("/")))
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, heads {args.heads}")
    rows = kernel_rows(args, heads)  # type: ignore[arg-type]
    print(f"{'case':>14} {'path':>22} {'ms':>9} {'TFLOP/s':>8} {'x sdpa':>7}")
    for row in rows:
        print(
            f"{row['case']:>14} {row['path']:>22} {row['ms']:>9.3f} {row['tflops']:>8.1f} "
            f"{row['vs_sdpa']:>7.2f}"
        )
    engine = engine_rows(args) if args.engine_prompts else []
    payload = {"benchmark": "prefill_kernel", "heads": args.heads, "kernel": rows, "engine": engine}
    print(f"-> {write_json('prefill_kernel.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
