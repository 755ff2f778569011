"""A transformers causal LM's decode step: HF eager, graphguard, torch.compile, side by side.

The same model (random bf16 weights, a transformers `StaticCache`) and the same decode step,
`model(input_ids, position_ids=..., attention_mask=..., past_key_values=cache)` with the inputs
`generate` gives it, each of these ways in one process:

- eager: the step as transformers runs it;
- graphguard: `graphguard.hf.GraphedCausalLM` (bounded, verified graphs of the step);
- graphguard fused: the same with graphguard's Triton kernels in the model's RMSNorms and
  SwiGLU MLPs (`GraphedCausalLM(kernels="fused")`, graphguard/hf_kernels.py);
- graphguard segmented: `GraphedCausalLM(mode="segmented")` (graphguard/hf_segments.py):
  graphed norms, MLPs and head with each layer's attention eager between them, what a model
  whose whole step is refused still gets;
- compile: `torch.compile(step, mode="reduce-overhead")` (CUDA graphs of compiled kernels).

Per model and batch: ms per decode step, the first run's extra time (graphguard: its capture;
compile: compiling), replays, whether the tokens equal eager's, and `memory_reserved()` growth.
Targets (issue 27): graphguard within 1.1x of compile's step time at batch 1, at least 10x
faster than eager, every token equal to eager's, reserved growth within the byte budget.

    python bench/hf_decode.py [--shapes qwen3-0.6b,llama-1b,mistral-1b-window] [--batches 1,8]
        [--new 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import write_json  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    ),
    "llama-1b": dict(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    ),
    # Llama-1B's shape with Mistral's sliding window, filled within the prompt and new tokens:
    # every layer's cache update is a hole between the step's graphs (graphguard/hf_cache.py)
    "mistral-1b-window": dict(
        family="mistral", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        sliding_window=64,
    ),
}  # fmt: skip
PROMPT = 32
BUDGET = 4 << 30


CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build(shape: str) -> Any:
    import transformers

    spec: dict[str, Any] = dict(SHAPES[shape])
    config_name, model_name = CLASSES[spec.pop("family")]
    config_class, model_class = (
        getattr(transformers, config_name),
        getattr(transformers, model_name),
    )
    config = config_class(**spec, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model: Any = model_class(config)
    model = model.to(dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def timed(run: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    began = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    return out, time.perf_counter() - began


def measure(model: Any, batch: int, new: int) -> dict[str, Any]:
    """One model and batch, every way (see module docstring)."""
    import graphguard as gg
    from graphguard.hf import GraphedCausalLM

    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device="cuda")
    eager = GraphedCausalLM(model, max_cache_len=PROMPT + new, backend="cuda",
                            capture=gg.CaptureConfig(enabled=False))  # fmt: skip
    reference, _ = timed(lambda: eager.generate(ids, max_new_tokens=new))
    _, eager_s = timed(lambda: eager.generate(ids, max_new_tokens=new))
    prefill = _prefill_s(eager, ids)
    row: dict[str, Any] = dict(batch=batch, eager_ms=(eager_s - prefill) / (new - 1) * 1e3)

    run = _graphed_twice(model, ids, new)
    row.update(
        graphguard_ms=(run.seconds - prefill) / (new - 1) * 1e3,
        graphguard_first_extra_s=run.first_s - run.seconds,
        replays=run.stats["replays"],
        fallbacks=run.stats["fallbacks"],
        graphguard_equal=run.equal(reference),
        reserved_growth_bytes=run.growth_bytes,
        graph_bytes=run.stats["resident_bytes"],
        budget_bytes=BUDGET,
    )
    row.update(_fused(model, ids, new, reference, prefill))
    row.update(_segmented(model, ids, new, reference, prefill))
    row.update(_compiled(model, ids, new, reference, prefill))
    return row


def _fused(
    model: Any, ids: torch.Tensor, new: int, reference: torch.Tensor, prefill: float
) -> dict[str, Any]:
    """graphguard with its fused kernels in the model's norms and MLPs: ms per step, whether
    its graphs' tokens equal its own eager run's, and how many equal transformers' kernels'."""
    import graphguard as gg
    from graphguard.hf import GraphedCausalLM

    eager = GraphedCausalLM(model, max_cache_len=PROMPT + new, backend="cuda", kernels="fused",
                            capture=gg.CaptureConfig(enabled=False))  # fmt: skip
    own = eager.generate(ids, max_new_tokens=new)
    eager.close()
    run = _graphed_twice(model, ids, new, kernels="fused")
    generated = slice(PROMPT, None)
    as_hf = (run.again[:, generated] == reference[:, generated]).float().mean()
    return dict(
        fused_ms=(run.seconds - prefill) / (new - 1) * 1e3,
        fused_first_extra_s=run.first_s - run.seconds,
        fused_replays=run.stats["replays"],
        fused_equal_own_eager=run.equal(own),
        fused_tokens_as_hf=float(as_hf),
        fused_reserved_growth_bytes=run.growth_bytes,
        fused_graph_bytes=run.stats["resident_bytes"],
    )


def _segmented(
    model: Any, ids: torch.Tensor, new: int, reference: torch.Tensor, prefill: float
) -> dict[str, Any]:
    """graphguard's segment graphs with eager attention holes: ms per step, replays, graphs,
    and whether the tokens equal eager's (or why the model cannot be cut)."""
    try:
        run = _graphed_twice(model, ids, new, mode="segmented")
    except ValueError as exc:  # a sliding-window cache, a layer not cut like Llama's
        return dict(segmented_refused=str(exc))
    return dict(
        segmented_ms=(run.seconds - prefill) / (new - 1) * 1e3,
        segmented_first_extra_s=run.first_s - run.seconds,
        segmented_replays=run.stats["replays"],
        segmented_fallbacks=run.stats["fallbacks"],
        segmented_graphs=run.stats["graphs"],
        segmented_bytes=run.stats["resident_bytes"],
        segmented_equal=run.equal(reference),
    )


class Run(NamedTuple):
    """Two timed generate calls of one GraphedCausalLM: the first captures, the second
    replays; its runner's stats (the segments' in segmented mode) and reserved growth."""

    first: torch.Tensor
    again: torch.Tensor
    first_s: float
    seconds: float
    stats: dict[str, Any]
    growth_bytes: int

    def equal(self, expected: torch.Tensor) -> bool:
        return bool(torch.equal(self.first, expected) and torch.equal(self.again, expected))


def _graphed_twice(model: Any, ids: torch.Tensor, new: int, **options: Any) -> Run:
    import graphguard as gg
    from graphguard.hf import GraphedCausalLM

    before = torch.cuda.memory_reserved()
    graphed = GraphedCausalLM(model, max_cache_len=PROMPT + new, max_bytes=BUDGET,
                              admission=gg.AdmissionConfig(min_hits=1), **options)  # fmt: skip
    first, first_s = timed(lambda: graphed.generate(ids, max_new_tokens=new))
    again, seconds = timed(lambda: graphed.generate(ids, max_new_tokens=new))
    runner = graphed.runner if graphed.segments is None else graphed.segments.runner
    run = Run(first, again, first_s, seconds, runner.stats(),
              torch.cuda.memory_reserved() - before)  # fmt: skip
    graphed.close()
    return run


def _prefill_s(runner: Any, ids: torch.Tensor) -> float:
    """Seconds of the eager prefill alone (generate with one new token)."""
    _, seconds = timed(lambda: runner.generate(ids, max_new_tokens=1))
    return seconds


def _compiled(
    model: Any, ids: torch.Tensor, new: int, reference: torch.Tensor, prefill: float
) -> dict[str, Any]:
    """The same decode loop with the step compiled (mode reduce-overhead)."""
    from graphguard.hf import GraphedCausalLM

    holder = GraphedCausalLM(model, max_cache_len=PROMPT + new, backend="cuda")
    step = torch.compile(holder._decode, mode="reduce-overhead")

    def generate() -> torch.Tensor:
        # NOTE: each token is picked before the next step overwrites the graph's output
        return holder.decode_loop(step, ids, new, lambda logits: logits.argmax(-1))

    try:
        with torch.no_grad():
            first, first_s = timed(generate)
            again, seconds = timed(generate)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal to the other columns
        return dict(compile_error=f"{type(exc).__name__}: {exc}"[:300])
    return dict(
        compile_ms=(seconds - prefill) / (new - 1) * 1e3,
        compile_first_extra_s=first_s - seconds,
        compile_equal=bool(torch.equal(again, reference)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-1b")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        model = build(shape)
        for batch in map(int, args.batches.split(",")):
            row = dict(shape=shape, **measure(model, batch, args.new))
            rows.append(row)
            print(_line(row), flush=True)
        del model
        torch.cuda.empty_cache()
    out = write_json("hf_decode.json", dict(rows=rows, new_tokens=args.new, prompt=PROMPT))
    print(f"hf_decode -> {out}")
    print(
        "     shape  batch  eager ms  gg ms  compile ms  gg/compile  x eager  gg first s"
        "  compile first s  equal gg/compile  reserved MiB"
    )
    for row in rows:
        print(_line(row))
    print("     shape  batch  fused ms  fused/compile  x eager  first s  equal own  as hf"
          "  reserved MiB")  # fmt: skip
    for row in rows:
        print(_fused_line(row))
    print("     shape  batch  eager ms  whole ms  segmented ms  x eager  first s  equal  graphs")
    for row in rows:
        print(_segmented_line(row))


def _line(row: dict[str, Any]) -> str:
    compile_ms = row.get("compile_ms", float("nan"))
    return (
        f"{row['shape']:>10} {row['batch']:>6} {row['eager_ms']:9.2f} {row['graphguard_ms']:6.2f}"
        f" {compile_ms:11.2f} {row['graphguard_ms'] / compile_ms:11.2f}"
        f" {row['eager_ms'] / row['graphguard_ms']:8.1f} {row['graphguard_first_extra_s']:11.2f}"
        f" {row.get('compile_first_extra_s', float('nan')):16.1f}"
        f" {row['graphguard_equal']!s:>6}/{row.get('compile_equal', row.get('compile_error'))!s}"
        f" {row['reserved_growth_bytes'] / 2**20:13.0f}  replays={row['replays']}"
        f" fallbacks={row['fallbacks']}"
    )


def _fused_line(row: dict[str, Any]) -> str:
    compile_ms = row.get("compile_ms", float("nan"))
    return (
        f"{row['shape']:>10} {row['batch']:>6} {row['fused_ms']:9.2f}"
        f" {row['fused_ms'] / compile_ms:14.2f} {row['eager_ms'] / row['fused_ms']:8.1f}"
        f" {row['fused_first_extra_s']:8.2f} {row['fused_equal_own_eager']!s:>10}"
        f" {row['fused_tokens_as_hf']:6.2f} {row['fused_reserved_growth_bytes'] / 2**20:13.0f}"
        f"  replays={row['fused_replays']}"
    )


def _segmented_line(row: dict[str, Any]) -> str:
    if "segmented_refused" in row:
        return f"{row['shape']:>10} {row['batch']:>6}  refused: {row['segmented_refused']}"
    return (
        f"{row['shape']:>10} {row['batch']:>6} {row['eager_ms']:9.2f}"
        f" {row['graphguard_ms']:9.2f} {row['segmented_ms']:13.2f}"
        f" {row['eager_ms'] / row['segmented_ms']:8.1f} {row['segmented_first_extra_s']:8.2f}"
        f" {row['segmented_equal']!s:>6} {row['segmented_graphs']:7d}"
        f"  replays={row['segmented_replays']} fallbacks={row['segmented_fallbacks']}"
    )


if __name__ == "__main__":
    main()
