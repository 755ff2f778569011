"""How close each CPU path of the embedded model is to float32, over the shipped corpus.

Scores graphguard/data/corpus.txt (about 3,600 positions in windows of 512 tokens) through the
engine's prefill in float32 (`--kernels torch`), bfloat16 and `--kernels q4`, and prints each
path's mean KL from float32, top-1 agreement and log-likelihood differences
(graphguard/engine/fidelity.py); then the same over `DECODE_STEPS` decode steps fed token by
token after a 200-token prompt (the decode path: its attention and head). Run it under forced
instruction-set levels to compare CPUs:

    python bench/cpu_fidelity.py [--threads 2]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        NUMBA_CPU_NAME=haswell python bench/cpu_fidelity.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import write_json  # noqa: E402
from graphguard.engine.fidelity import (  # noqa: E402
    Scored,
    compare,
    corpus_text,
    score_decode,
    score_text,
)
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.models.loader import load_model  # noqa: E402
from graphguard.kernels.isa import cpu_features  # noqa: E402

PATHS = {
    "float32": ("float32", "torch"),
    "bfloat16": ("bfloat16", "torch"),
    "q4": ("float32", "q4"),
}


PROMPT_TOKENS, DECODE_STEPS = 200, 128


def score(dtype: str, kernels: str) -> tuple[Scored, Scored]:
    """The corpus through the prefill, and the decode steps."""
    loaded = load_model(None, dtype=dtype, device="cpu", progress=False)
    llm = LLM(loaded, kernels=kernels, max_model_len=512, max_num_seqs=2)
    try:
        text = corpus_text()
        prefill = score_text(llm.engine, text)
        return prefill, score_decode(llm.engine, text, PROMPT_TOKENS, DECODE_STEPS)
    finally:
        llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="cpu_fidelity.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = score(*PATHS["float32"])
    rows = {}
    for name in ("bfloat16", "q4"):
        prefill, decode = score(*PATHS[name])
        rows[name] = compare(reference[0], prefill).as_dict()
        rows[f"{name} decode"] = compare(reference[1], decode).as_dict()
    features = ", ".join(cpu_features())
    path = write_json(args.out, dict(cpu_features=features, rows=rows))
    print(f"corpus figures against float32, cpu: {features} -> {path}")
    print(f"{'path':>16} {'positions':>9} {'KL':>9} {'top-1':>7} {'|dlogp|':>8} {'dNLL':>8}")
    for name, row in rows.items():
        print(f"{name:>16} {row['positions']:9d} {row['kl']:9.5f} {row['top1']:7.4f} "
              f"{row['logprob_diff']:8.4f} {row['nll_diff']:8.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
