"""Single-stream decode of the embedded model on the CPU: float32, bfloat16, and bfloat16 with
the 4-bit GEMMs (`--kernels q4`, graphguard/kernels/q4.py), side by side in one run.

64 greedy tokens after "The capital of France is" (EOS ignored), after one untimed run, timed
`--repeats` times (the median is the figure; a shared 2-core machine varies by 20% from one
run to the next); the chat answer to "What is the capital of France?" and the continuation of
"1, 2, 3, 4," in each configuration. The CPU features the kernels use are printed first.

    python bench/cpu_decode.py [--threads 2] [--configs float32,bfloat16,q4] [--repeats 5]

`--configs ...,llama.cpp` adds llama.cpp on the same GGUF file, through the llama-cpp-python
package where it is installed (it is not a dependency: it compiles llama.cpp for minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import write_json  # noqa: E402
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.models.loader import embedded_gguf_path, load_model  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402
from graphguard.kernels.isa import cpu_features  # noqa: E402

PROMPT, NEW_TOKENS = "The capital of France is", 64


def measure(config: str, repeats: int) -> dict:
    # q4 packs the float32 weights; its activations stay float32 (graphguard/kernels/q4.py)
    loaded = load_model(None, dtype="float32" if config == "q4" else config, device="cpu")
    kernels = "q4" if config == "q4" else "auto"
    llm = LLM(loaded, max_model_len=512, max_num_seqs=4, kernels=kernels)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        llm.generate([PROMPT], params, use_tqdm=False)
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            (out,) = llm.generate([PROMPT], params, use_tqdm=False)
            rates.append(NEW_TOKENS / (time.perf_counter() - start))
        short = SamplingParams(temperature=0.0, max_tokens=24)
        (chat,) = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}], short, use_tqdm=False
        )
        count = llm.generate(["1, 2, 3, 4,"], short, use_tqdm=False)[0]
        return dict(
            config=config, tok_s=statistics.median(rates), best_tok_s=max(rates),
            runs_tok_s=rates, chat=chat.outputs[0].text, count=count.outputs[0].text,
            continuation=out.outputs[0].text,
        )  # fmt: skip
    finally:
        llm.engine.shutdown()


def measure_llama_cpp(threads: int, repeats: int) -> dict:
    """llama.cpp (the llama-cpp-python package, when installed) on the same GGUF file."""
    from llama_cpp import Llama

    gguf = str(embedded_gguf_path())
    llm = Llama(model_path=gguf, n_threads=threads, n_ctx=512, verbose=False, seed=0)
    no_eos = {llm.token_eos(): float("-inf")}

    def complete(prompt: str, max_tokens: int, **extra: object) -> dict:
        return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, **extra)

    complete(PROMPT, NEW_TOKENS, logit_bias=no_eos)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = complete(PROMPT, NEW_TOKENS, logit_bias=no_eos)
        rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.create_chat_completion(question, max_tokens=24, temperature=0.0)
    return dict(
        config="llama.cpp", tok_s=statistics.median(rates), best_tok_s=max(rates),
        runs_tok_s=rates, chat=chat["choices"][0]["message"]["content"],
        count=complete("1, 2, 3, 4,", 24)["choices"][0]["text"],
        continuation=out["choices"][0]["text"],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--configs", default="float32,bfloat16,q4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    features = ", ".join(cpu_features())
    rows = [
        measure_llama_cpp(args.threads, args.repeats)
        if config == "llama.cpp"
        else measure(config, args.repeats)
        for config in args.configs.split(",")
    ]
    path = write_json(
        "cpu_decode.json", dict(threads=args.threads, cpu_features=features, rows=rows)
    )
    print(f"single-stream CPU decode, {args.threads} threads, cpu: {features} -> {path}")
    for row in rows:
        print(f"{row['config']:>12} {row['tok_s']:6.1f} tok/s (best {row['best_tok_s']:.1f})  "
              f"chat {row['chat']!r}  count {row['count'][:20]!r}")  # fmt: skip


if __name__ == "__main__":
    main()
