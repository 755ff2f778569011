"""Where a long-context decode step's device time goes: the decode step alone
(`engine.forward.decode`, one row) captured as a raw CUDA graph at 512 / 8k / 30k tokens of
context, then the CUDA kernels of three eager steps at the longest, by total time.

bench/long_context.py measures a 30k-token stream's whole step; bench/decode_attention.py the
attention kernel alone. This one says whether the gap between them is on the device (the
replay's time) or on the host (the step's wall time minus it), and which kernels hold it.

`--variants` times the step under the kernel set's options side by side in this one process,
each captured afresh on the same model and cache, and prints each one's ratio to the first:

- `plain`: the default kernels launched plainly (GRAPHGUARD_PDL=0);
- `pdl`: every kernel launched as a dependent (graphguard/kernels/launch.py): the engine's
  default on Hopper and later, so `pdl` is the engine's step;
- `prologues`: norms and SiLU inside the GEMMs (GRAPHGUARD_GEMM_PROLOGUES=1);
- `merge8`: the split decode attention's merge with 8 programs a query head, each loading up
  to 64 splits' partials at once, at every width (decode_plan.py's `merge_programs`,
  `merge_chunk`; the default rule merges so from 64 splits on, contexts past 8k);
- `split`: the few-rows GEMM splits K where a weight has few output features
  (GRAPHGUARD_SPLIT_K=1, graphguard/kernels/triton_linear.py);
- `dot1`: a batch of one through the few-rows GEMM (the matrix unit, rows padded to 16), as
  before `one_row_linear` took it (graphguard/kernels/triton_linear.py);
- a `+` joins them: `pdl+merge8`; a name given twice runs twice (`plain,pdl,plain`).

Beside the times, each variant's logits at the longest context against the first's: dependent
launches give the same bits, the GEMM prologues and the wider merge differ in the last bits.

    python bench/long_decode_profile.py [--contexts 512,8192,30000] [--shape qwen3-0.6b]
        [--variants plain,pdl,prologues,merge8,split] [--profile-rows 12]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.long_context import load  # noqa: E402
from bench.timing import graph_replay_ms, write_json  # noqa: E402
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.shapes import width_bucket  # noqa: E402
from graphguard.kernels import launch, triton_decode  # noqa: E402
from graphguard.kernels.decode_plan import SPLIT_RULE  # noqa: E402

BLOCK_SIZE = 16
OPTIONS = ("pdl", "prologues", "merge8", "split", "dot1")


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


def label_repeats(names: list[str]) -> list[str]:
    """The variants' names, a repeat labelled with its count (`plain`, then `plain#2`): a
    variant run again last shows how far the machine drifted over the run."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return labels


def parse_variant(name: str) -> frozenset[str]:
    parts = frozenset(name.split("+")) - {"plain"}
    if unknown := parts - set(OPTIONS):
        raise SystemExit(f"unknown variant option(s) {sorted(unknown)}: choose from {OPTIONS}")
    return parts


@contextlib.contextmanager
def variant(kernels: Any, options: frozenset[str]) -> Iterator[None]:
    """The kernel set `kernels` with `options` on, for the block; as it was after."""
    index = torch.cuda.current_device()
    saved_pdl = launch._BY_DEVICE.get(index)
    saved = kernels.gemm_prologues, kernels.split_k, kernels.one_row
    if "pdl" in options and torch.cuda.get_device_capability(index)[0] < 9:
        raise SystemExit("pdl needs Hopper or later")
    launch._BY_DEVICE[index] = "pdl" in options
    kernels.gemm_prologues = "prologues" in options
    kernels.split_k = "split" in options
    kernels.one_row = "dot1" not in options
    if "merge8" in options:
        rule = dataclasses.replace(SPLIT_RULE, merge_programs=8, merge_chunk=64)
        kernels.decode_attention = functools.partial(triton_decode.decode_attention, rule=rule)
    try:
        yield
    finally:
        if saved_pdl is None:
            launch._BY_DEVICE.pop(index, None)
        else:
            launch._BY_DEVICE[index] = saved_pdl
        kernels.gemm_prologues, kernels.split_k, kernels.one_row = saved
        kernels.__dict__.pop("decode_attention", None)


def kernel_table(decode: Any, inputs: tuple[torch.Tensor, ...], rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    decode(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            decode(*inputs)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="512,8192,30000")
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--variants", default="plain", help="comma-separated; the first is 1.0x")
    parser.add_argument("--profile-rows", type=int, default=12, help="kernels in each table")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    names = label_repeats(args.variants.split(","))
    variants = {name: parse_variant(name.split("#")[0]) for name in names}
    longest = max(contexts)
    llm = LLM(load(args.shape, False), max_model_len=longest + 64, max_num_seqs=1,
              num_kv_blocks=longest // BLOCK_SIZE + 64, batch_buckets=(1,),
              prefix_caching=False)  # fmt: skip
    decode, kernels = llm.engine.forward.decode, llm.engine.kernels.kernels
    # NOTE: random K/V everywhere, and every variant's logits taken before any timed call: each
    # reads the same context and writes only the slot it then reads, so a variant's drift from
    # the first is its kernels' alone (the timed calls write the slots of every context)
    caches = (*llm.engine.kv.k_cache, *llm.engine.kv.v_cache)
    generator = torch.Generator(device=caches[0].device).manual_seed(0)
    for cache in caches:
        cache.normal_(generator=generator)
    logits: dict[str, torch.Tensor] = {}
    failed: dict[str, Exception] = {}
    for name, options in variants.items():
        try:
            with variant(kernels, options):
                logits[name] = decode(*decode_inputs(longest)).float()
        except Exception as exc:  # noqa: BLE001 - one variant's failure is a row, not the run
            failed[name] = exc
    times: dict[str, dict[int, float]] = {}
    for name, options in variants.items():
        try:
            if name in failed:
                raise failed[name]
            with variant(kernels, options):
                times[name] = {}
                for context in contexts:
                    times[name][context] = graph_replay_ms(decode, *decode_inputs(context))
                    print(f"{name:>16} context {context:>6}: decode step alone "
                          f"{times[name][context]:.3f} ms", flush=True)  # fmt: skip
                table = kernel_table(decode, decode_inputs(longest), args.profile_rows)
                print(f"kernels of 3 eager steps at {longest} tokens, {name}\n{table}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one variant's failure is a row, not the run
            print(f"{name:>16}: failed, {type(exc).__name__}: {exc}", flush=True)
            times.pop(name, None)
    device = torch.cuda.get_device_name()
    first = next((n for n in names if n in times), None)
    if first is None:
        raise SystemExit("no variant ran")
    base, expected = times[first], logits[first]
    print(f"-> decode step alone (raw graph, ms; ratio to {first}), {device}; logits at "
          f"{longest} tokens against {first}'s (max |diff| / max |logit|)")  # fmt: skip
    print(f"{'variant':>16} " + " ".join(f"{c:>16}" for c in contexts) + f"{'logits':>10}")
    for name in (n for n in names if n in times):
        cells = [f"{times[name][c]:.3f} ({times[name][c] / base[c]:.3f}x)" for c in contexts]
        drift = ((logits[name] - expected).abs().max() / expected.abs().max()).item()
        print(f"{name:>16} " + " ".join(f"{cell:>16}" for cell in cells) + f"{drift:>10.1e}")
    rows = [dict(variant=n, context=c, step_ms=times[n][c]) for n in times for c in contexts]
    write_json("long_decode_profile.json", dict(device=device, rows=rows))
    llm.shutdown()


if __name__ == "__main__":
    main()
