"""Decode throughput: this engine eager vs with graphs (reference and fused kernels) vs HF
transformers `generate`.

Random bf16 weights of the SmolLM2-135M and Qwen3-0.6B shapes, 16-token prompts, 128 new tokens
(EOS ignored), at concurrency 1, 8, 32 and 64, all in one run. Columns: the engine eager with the
reference (torch) kernels, with graphs and the torch kernels, with graphs and the fused Triton
kernels (each decode step launched before the host reads the last one's tokens, the default on
CUDA), the same with that overlap off, HF generate. Targets (fused): Qwen3 batch 1 >= 500 tok/s,
SmolLM2 batch 1 >= 800, Qwen3 at 64 >= 12,000, SmolLM2 at 64 >= 25,000. For the fused
configuration the bench also replays the decode step alone as a raw CUDA graph at the batch's
shape and reports the host's share of a step (step wall time minus that replay's device time).
Graph resident bytes are reported next to KV bytes. Steady state: each engine configuration runs
twice untimed first (captures happen there), then timed.

    python bench/decode.py [--shapes smollm2-135m,qwen3-0.6b] [--concurrency 1,8,32,64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

# Pinned cuBLAS workspaces: the same kernels on every stream (docs/runtime.md).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import graph_replay_ms, out_dir, write_json  # noqa: E402
from graphguard.engine.config import PRESETS, ModelConfig, engine_config  # noqa: E402
from graphguard.engine.engine import LLMEngine  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.loader import LoadedModel, config_to_hf  # noqa: E402
from graphguard.engine.scheduling.kv import PagedKVStorage  # noqa: E402
from graphguard.engine.shapes import width_bucket  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 16, 128


class NumberTokenizer:
    """Random-weight benchmarks have no vocabulary: ids print as numbers."""

    def __init__(self, config: ModelConfig) -> None:
        self.eos_token_ids = config.eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.split()]

    def token_to_id(self, token: str) -> int | None:
        return None  # no special tokens (so no image placeholder either)


def prompts(num: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(num)
    return torch.randint(10, vocab - 10, (num, PROMPT_LEN), generator=g).tolist()


def engine_tok_s(
    loaded: LoadedModel,
    concurrency: int,
    eager: bool,
    kernels: str = "torch",
    overlap: str = "auto",
) -> tuple[float, dict]:
    config = engine_config(
        enforce_eager=eager,
        kernels=kernels,
        overlap_decode=overlap,
        max_num_seqs=64,
        max_model_len=PROMPT_LEN + NEW_TOKENS + 16,
        max_num_batched_tokens=64 * PROMPT_LEN,
        num_kv_blocks=64 * 10 + 1,
        max_graph_bytes=8 << 30,
    )
    engine = LLMEngine(config, loaded)
    try:
        for _ in range(2):  # warm-up: keys earn their captures (min_hits=2) here, not below
            run_requests(engine, concurrency, max_tokens=NEW_TOKENS)
        steps_before = engine.stats()["num_steps"]
        start = time.perf_counter()
        run_requests(engine, concurrency, max_tokens=NEW_TOKENS)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        num_steps = engine.stats()["num_steps"] - steps_before
        extra = {
            "kv_bytes": engine.kv.kv_bytes,
            "ms_per_step": 1e3 * seconds / num_steps,
            "steps_ahead": engine.stats()["num_steps_ahead"],
        }
        if not eager:
            extra["replay_ms"] = replay_ms(engine, concurrency)
        if engine.graphs is not None:
            stats = engine.graphs.stats()
            extra.update(
                graph_resident_bytes=stats["resident_bytes"],
                graphs=stats["entries"],
                fallbacks=stats["fallbacks"],
                captures=stats["captures"],
            )
        return concurrency * NEW_TOKENS / seconds, extra
    finally:
        engine.shutdown()


def replay_ms(engine: LLMEngine, batch: int) -> float:
    """Device time of the decode step alone, captured as a raw CUDA graph at `batch` rows and
    the width of a mid-generation step, median of 50 replays."""
    blocks = -(-(PROMPT_LEN + NEW_TOKENS // 2) // engine.config.block_size)
    width = width_bucket(blocks)
    dummy = PagedKVStorage.DUMMY_BLOCK
    tables = torch.full((batch, width), dummy, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), PROMPT_LEN + NEW_TOKENS // 2, dtype=torch.int32, device="cuda")
    ids = torch.zeros(batch, dtype=torch.int64, device="cuda")
    positions, slots = (lens - 1).long(), torch.zeros(batch, dtype=torch.int64, device="cuda")
    return graph_replay_ms(engine.forward.decode, ids, positions, tables, lens, slots)


def run_requests(engine: LLMEngine, concurrency: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts(concurrency, engine.model_config.vocab_size)):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()


def hf_tok_s(config: ModelConfig, concurrency: int) -> float:
    import transformers

    hf = config_to_hf(config)
    names = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    cfg_name, model_name = names[config.arch]
    hf_config = getattr(transformers, cfg_name)(**{k: v for k, v in hf.items() if k != "dtype"})
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(hf_config).to(torch.bfloat16).eval()
    ids = torch.tensor(prompts(concurrency, config.vocab_size), device="cuda")
    kwargs = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
    )
    model.generate(
        ids[:, :4],
        **{
            **kwargs,
            "max_new_tokens": 4,
            "min_new_tokens": 4,
            "attention_mask": torch.ones_like(ids[:, :4]),
        },
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return concurrency * NEW_TOKENS / seconds


def measure(shape: str, levels: list[int], with_hf: bool) -> list[dict]:
    config = PRESETS[shape]
    model = build_model(config, dtype=torch.bfloat16, device="cuda", seed=0)
    loaded = LoadedModel(shape, model, config, NumberTokenizer(config))  # type: ignore[arg-type]
    rows = []
    for c in levels:
        eager, _ = engine_tok_s(loaded, c, eager=True)
        graphs_torch, _ = engine_tok_s(loaded, c, eager=False, kernels="torch")
        graphs, extra = engine_tok_s(loaded, c, eager=False, kernels="triton")
        serial, serial_extra = engine_tok_s(loaded, c, eager=False, kernels="triton", overlap="off")
        hf = hf_tok_s(config, c) if with_hf else float("nan")
        rows.append(
            dict(
                shape=shape,
                concurrency=c,
                eager_tok_s=eager,
                graphs_torch_tok_s=graphs_torch,
                graphs_tok_s=graphs,
                graphs_serial_tok_s=serial,
                hf_tok_s=hf,
                overlap_vs_serial=graphs / serial,
                serial_ms_per_step=serial_extra["ms_per_step"],
                graphs_vs_eager=graphs / eager,
                fused_vs_torch=graphs / graphs_torch,
                graphs_vs_hf=graphs / hf,
                host_ms_per_step=extra["ms_per_step"] - extra["replay_ms"],
                **extra,
            )
        )
        print(
            f"  {shape} c={c}: eager {eager:.0f}, graphs torch {graphs_torch:.0f}, graphs fused "
            f"{graphs:.0f} (overlap off {serial:.0f}), hf {hf:.0f} tok/s; step "
            f"{extra['ms_per_step']:.2f} ms (off {serial_extra['ms_per_step']:.2f}), replay "
            f"{extra['replay_ms']:.2f} ms",
            flush=True,
        )
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2-135m,qwen3-0.6b")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = [r for s in args.shapes.split(",") for r in measure(s, levels, not args.no_hf)]
    path = write_json("decode.json", dict(prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, rows=rows))
    plot(rows)
    print(f"decode (bf16, random weights, {NEW_TOKENS} new tokens) -> {path}")
    print(
        f"{'shape':>13} {'conc':>4} {'eager':>7} {'g-torch':>7} {'g-fused':>7} {'serial':>7} "
        f"{'hf':>7} "
        f"{'x torch':>7} {'x hf':>6} {'step ms':>7} {'replay':>6} {'host':>6} {'graph MiB':>9}"
    )
    for r in rows:
        print(
            f"{r['shape']:>13} {r['concurrency']:>4} {r['eager_tok_s']:>7.0f} "
            f"{r['graphs_torch_tok_s']:>7.0f} {r['graphs_tok_s']:>7.0f} "
            f"{r['graphs_serial_tok_s']:>7.0f} {r['hf_tok_s']:>7.0f} "
            f"{r['fused_vs_torch']:>7.2f} {r['graphs_vs_hf']:>6.1f} {r['ms_per_step']:>7.2f} "
            f"{r['replay_ms']:>6.2f} {r['host_ms_per_step']:>6.2f} "
            f"{r.get('graph_resident_bytes', 0) / 2**20:>9.0f}"
        )


def plot(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        mine = [r for r in rows if r["shape"] == shape]
        xs = [r["concurrency"] for r in mine]
        for key, label in (
            ("graphs_tok_s", "graphguard graphs, fused kernels"),
            ("graphs_serial_tok_s", "the same, no decode overlap"),
            ("graphs_torch_tok_s", "graphguard graphs, torch kernels"),
            ("eager_tok_s", "engine eager"),
            ("hf_tok_s", "HF generate"),
        ):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="tokens/s", title=shape)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir() / "decode.png", dpi=120)


if __name__ == "__main__":
    main()
