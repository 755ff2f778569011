"""Long prompts and long contexts: prefill and decode tok/s at 512 / 8k / 32k-token prompts for
batch 1 and 16, each beside its floor, and a shared-prefix serving load (TTFT with prefix
caching on and off), all through the public `LLM` API and its engine, in process.

Random bf16 weights of the Qwen3-0.6B and Llama-3.1-8B shapes, both with a 49,152-token
vocabulary (as bench/decode.py's SmolLM2 shape and the figures in docs/benchmarks.md).

- prefill tok/s: prompt tokens / wall time of a prefill-only call (`max_tokens=1`) of `batch`
  fresh prompts, after an untimed call of one prompt of the same length (compiles, first GEMM
  calls and graphs the lazy start had not captured happen there). Floor: the call's FLOPs (2 x
  the decoder's matrix parameters per token, plus causal attention, 2 x heads x head_dim x
  length^2 per layer) at DENSE_BF16_FLOPS, the dense bf16 peak of an H100/H200 SXM (989 TFLOP/s).
- decode tok/s: the same prompts again (their KV blocks come from the prefix cache), then,
  once every stream has its first token and WARM_STEPS more steps ran, generated tokens /
  wall time of the next `--decode-tokens` steps (`decode_replays`: how many of them replayed a
  graph); the requests are then aborted. Floor: one step reads every weight byte and every
  stream's KV once, at HBM_BYTES_PER_S.
- shared prefix (bench/shared_prefix.py): `--clients` clients each ask `--rounds` questions
  in turn after one `--prefix`-token document; TTFT p50 / p99 with prefix caching on and off.

A row whose KV pool does not fit the device's free memory is skipped with the reason, as are
the rows `--skip` names (by default Llama-3.1-8B's 16 streams of 32k, which alone would take
minutes). The default run is sized to take about 8 minutes on an H200.

    python bench/long_context.py [--shapes qwen3-0.6b,llama-3.1-8b] [--prompts 512,8192,32768]
        [--batches 1,16] [--skip llama-3.1-8b:32768:16] [--decode-tokens 64] [--no-shared]
    python bench/long_context.py --tiny   # CPU smoke scale (tests/unit/bench)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import torch

# Pinned cuBLAS workspaces: the same kernels on every stream (docs/runtime.md).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode import NumberTokenizer  # noqa: E402
from bench.shared_prefix import SharedLoad, random_prompts, shared_prefix  # noqa: E402
from bench.timing import out_dir, sync, write_json  # noqa: E402
from graphguard.engine.config import PRESETS, STEP_TOKENS, EngineConfig, ModelConfig  # noqa: E402
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.loader import LoadedModel  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402

HBM_BYTES_PER_S = 4.25e12  # H200 HBM (a 4.2 TB/s copy was measured there)
DENSE_BF16_FLOPS = 989e12  # H100 / H200 SXM dense bf16 peak
VOCAB = 49152
BLOCK_SIZE = EngineConfig().block_size  # the engine's default KV block
WARM_STEPS = 8  # decode steps after the last first token, before the timed ones
SHAPES = {
    "qwen3-0.6b": dataclasses.replace(PRESETS["qwen3-0.6b"], vocab_size=VOCAB),
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
}  # fmt: skip
# --tiny: the same families at a size the CPU runs in seconds
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)  # fmt: skip


def matrix_params(config: ModelConfig) -> int:
    """Parameters of the decoder layers' matrices (q, k, v, o, gate, up, down)."""
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (2 * q_dim + 2 * kv_dim)
    return config.num_layers * (attention + 3 * config.hidden_size * config.intermediate_size)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    size = torch.finfo(dtype).bits // 8
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * size


def weight_bytes(model: torch.nn.Module) -> int:
    """Every weight byte a decode step reads (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prefill_floor_s(config: ModelConfig, batch: int, length: int) -> float:
    attention = 2 * config.num_layers * config.num_heads * config.head_dim * length**2
    head = 2 * config.vocab_size * config.hidden_size  # the last token's logits
    return batch * (2 * matrix_params(config) * length + attention + head) / DENSE_BF16_FLOPS


def decode_floor_s(weights: int, kv_per_token: int, batch: int, context: int) -> float:
    return (weights + batch * context * kv_per_token) / HBM_BYTES_PER_S


def prefill_s(llm: LLM, batch: list[list[int]]) -> float:
    """Wall time of a prefill-only call (one token each)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync()
    start = time.perf_counter()
    llm.generate_from_token_ids(batch, params, use_tqdm=False)
    sync()
    return time.perf_counter() - start


def decode_run(llm: LLM, batch: list[list[int]], steps: int, max_tokens: int) -> dict:
    """Generated tokens / wall time of `steps` steps once every stream has its first token
    (and WARM_STEPS more ran); the requests are aborted after."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"decode-{i}-{time.monotonic_ns()}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch, strict=True):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    for _ in range(WARM_STEPS):
        engine.step()
    graphs_before = engine.graphs.stats() if engine.graphs is not None else None
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    result = dict(decode_tok_s=tokens / seconds, decode_ms_per_step=1e3 * seconds / steps,
                  decode_streams=tokens / steps, decode_steps=steps)  # fmt: skip
    if graphs_before is not None and engine.graphs is not None:
        after = engine.graphs.stats()
        result["decode_replays"] = after["replays"] - graphs_before["replays"]
    return result


def pool_blocks(batch: int, length: int, extra: int) -> int:
    """KV blocks for `batch` streams of `length` + `extra` tokens and one cached prompt more."""
    per_stream = -(-(length + extra) // BLOCK_SIZE) + 1
    return batch * per_stream + -(-length // BLOCK_SIZE) + 8


def free_bytes(args: argparse.Namespace) -> int:
    """What a KV pool may take: the device's free memory less a margin (graphs, activations),
    or --cpu-kv-gib on the CPU."""
    if not torch.cuda.is_available():
        return int(args.cpu_kv_gib * 2**30)
    free, _ = torch.cuda.mem_get_info()
    return int(free - args.margin_gib * 2**30)


def length_rows(loaded: LoadedModel, length: int, args: argparse.Namespace) -> list[dict]:
    """Every batch's row at one prompt length: measured, or skipped with the reason."""
    config, name = loaded.config, loaded.name
    kv_token = kv_bytes_per_token(config, next(loaded.model.parameters()).dtype)
    rows: list[dict] = []
    runnable = []
    for batch in args.batch_sizes:
        row = dict(shape=name, prompt_tokens=length, batch=batch)
        chunk = args.batched_tokens or STEP_TOKENS  # the smallest a default budget can be
        extra = args.decode_tokens + WARM_STEPS + -(-batch * length // chunk) + 32
        need = pool_blocks(batch, length, extra) * BLOCK_SIZE * kv_token
        if f"{name}:{length}:{batch}" in args.skip:
            row["skipped"] = "--skip"
        elif need > (room := free_bytes(args)):
            row["skipped"] = f"KV pool {need / 2**30:.1f} GiB > {room / 2**30:.1f} GiB free"
        else:
            runnable.append((batch, extra))
        if "skipped" in row:
            print(f"  {describe(row)}", flush=True)
        rows.append(row)
    if not runnable:
        return rows
    largest = max(batch for batch, _ in runnable)
    extra = max(e for _, e in runnable)
    llm = LLM(
        loaded, max_model_len=length + extra + BLOCK_SIZE, max_num_seqs=largest,
        num_kv_blocks=pool_blocks(largest, length, extra), batch_buckets=tuple({1, largest}),
        max_num_batched_tokens=args.batched_tokens and max(args.batched_tokens, largest),
        enforce_eager=args.eager,
        prefix_caching=True,
    )  # fmt: skip
    try:
        prefill_s(llm, random_prompts(1, length, config.vocab_size, seed=length))  # warm-up
        weights = weight_bytes(loaded.model)
        for row in rows:
            if "skipped" not in row:
                row.update(measure(llm, row, weights, kv_token, args))
                row["step_tokens"] = llm.engine.step_tokens
                print(f"  {describe(row)}", flush=True)
    finally:
        llm.shutdown()
        del llm
        release_memory()
    return rows


def release_memory() -> None:
    """Give back what a finished engine or model held before the next one sizes its pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(llm: LLM, row: dict, weights: int, kv_token: int, args: argparse.Namespace) -> dict:
    config = llm.engine.model_config
    batch, length = row["batch"], row["prompt_tokens"]
    fresh = random_prompts(batch, length, config.vocab_size, seed=1000 * batch + length)
    seconds = prefill_s(llm, fresh)
    floor_s = prefill_floor_s(config, batch, length)
    decode = decode_run(llm, fresh, args.decode_tokens, llm.engine.max_model_len - length)
    context = length + WARM_STEPS + args.decode_tokens // 2  # mid-window, at least
    step_floor_s = decode_floor_s(weights, kv_token, batch, context)
    return dict(
        prefill_tok_s=batch * length / seconds, prefill_floor_tok_s=batch * length / floor_s,
        prefill_fraction=floor_s / seconds, prefill_s=seconds, **decode,
        decode_floor_tok_s=batch / step_floor_s,
        decode_fraction=decode["decode_tok_s"] * step_floor_s / batch,
        weight_bytes=weights, kv_bytes_per_token=kv_token, decode_context=context,
    )  # fmt: skip


def describe(row: dict) -> str:
    head = f"{row['shape']:>12} {row['prompt_tokens']:>6} x {row['batch']:>2}"
    if "skipped" in row:
        return f"{head}: skipped ({row['skipped']})"
    return (
        f"{head}: prefill {row['prefill_tok_s']:>9,.0f} tok/s (floor "
        f"{row['prefill_floor_tok_s']:>11,.0f}, {100 * row['prefill_fraction']:5.1f}%), decode "
        f"{row['decode_tok_s']:>7,.0f} tok/s (floor {row['decode_floor_tok_s']:>8,.0f}, "
        f"{100 * row['decode_fraction']:5.1f}%)"
        # a timed decode step that ran eagerly says the row's figure is not the graphs'
        + (f", {row['decode_replays']} of {row['decode_steps']} steps replayed"
           if "decode_replays" in row else "")
    )  # fmt: skip


def plot(rows: list[dict]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    done = [r for r in rows if "skipped" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("prefill", "decode"), strict=True):
        for shape, batch in sorted({(r["shape"], r["batch"]) for r in done}):
            mine = [r for r in done if (r["shape"], r["batch"]) == (shape, batch)]
            xs = [r["prompt_tokens"] for r in mine]
            line = ax.plot(xs, [r[f"{key}_tok_s"] for r in mine], marker="o",
                           label=f"{shape} x{batch}")  # fmt: skip
            ax.plot(xs, [r[f"{key}_floor_tok_s"] for r in mine], ls=":", color=line[0].get_color())
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="tokens/s",
               title=f"{key} (dotted: floor)")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir() / "long_context.png"
    fig.savefig(path, dpi=120)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    parser.add_argument("--prompts", default="512,8192,32768")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument(
        "--skip",
        default="llama-3.1-8b:32768:16",
        help="rows not to run, as shape:prompt_tokens:batch, comma-separated",
    )
    parser.add_argument("--decode-tokens", type=int, default=64, help="timed decode steps")
    parser.add_argument(
        "--batched-tokens",
        type=int,
        default=0,
        help="EngineConfig.max_num_batched_tokens (the prefill chunk); 0: the engine's default",
    )
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-shared", action="store_true", help="no shared-prefix load")
    parser.add_argument("--shared-shape", default="qwen3-0.6b")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=4096, help="shared document tokens")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--margin-gib", type=float, default=6.0)
    parser.add_argument("--cpu-kv-gib", type=float, default=2.0)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = parser.parse_args(argv)
    args.prompt_lengths = [int(n) for n in args.prompts.split(",")]
    args.batch_sizes = [int(n) for n in args.batches.split(",")]
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def load(shape: str, tiny: bool) -> LoadedModel:
    config = SHAPES[shape]
    if tiny:
        config = dataclasses.replace(config, **TINY)  # type: ignore[arg-type]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(config, dtype=dtype, device=device, seed=0)
    return LoadedModel(shape, model, config, NumberTokenizer(config))  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    rows: list[dict] = []
    shared: list[dict] = []
    for shape in args.shapes.split(","):
        loaded = load(shape, args.tiny)
        for length in args.prompt_lengths:
            rows += length_rows(loaded, length, args)
        if shape == args.shared_shape and not args.no_shared:
            spec = SharedLoad(args.clients, args.rounds, args.prefix, args.question,
                              args.answer_tokens, args.batched_tokens, args.eager)  # fmt: skip
            shared = [shared_prefix(loaded, spec, caching) for caching in (True, False)]
        del loaded
        release_memory()
    peaks = dict(hbm_bytes_per_s=HBM_BYTES_PER_S, dense_bf16_flops=DENSE_BF16_FLOPS)
    payload = dict(peaks=peaks, vocab=VOCAB, tiny=args.tiny, rows=rows, shared_prefix=shared)
    path = write_json("long_context.json", payload)
    picture = plot(rows)
    report(rows, shared, path, picture)
    return path


def report(rows: list[dict], shared: list[dict], path: Path, picture: Path | None) -> None:
    print(f"long context (bf16, random weights, vocab {VOCAB}; floors: "
          f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s, {DENSE_BF16_FLOPS / 1e12:.0f} TFLOP/s dense) "
          f"-> {path}{f', {picture}' if picture else ''}")  # fmt: skip
    for row in rows:
        print(f"  {describe(row)}")
    for run in shared:
        print(
            f"  shared prefix {run['prefix_tokens']} tokens, {run['clients']} clients, "
            f"caching {'on ' if run['prefix_caching'] else 'off'}: TTFT p50 "
            f"{run['ttft_p50_ms']:.1f} / p99 {run['ttft_p99_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
