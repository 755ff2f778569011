"""The CPU paths under each instruction-set level PyTorch, oneDNN, MKL and Numba can be held
to on this machine: every level's answers stay within the corpus figures (a CPU of another
kind is one of these levels), and the startup log names the level that runs.

The variables are read once when a process starts, so each level runs in a process of its
own, over the corpus's first window (graphguard/engine/fidelity.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphguard.kernels.isa import cpu_flags

# level -> (the CPU flag it needs, the variables that hold every library to it)
LEVELS = {
    "avx2": (
        "avx2",
        dict(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
             MKL_ENABLE_INSTRUCTIONS="AVX2", NUMBA_CPU_NAME="haswell"),
    ),
    "avx512": (
        "avx512f",
        dict(ATEN_CPU_CAPABILITY="avx512", ONEDNN_MAX_CPU_ISA="AVX512_CORE",
             MKL_ENABLE_INSTRUCTIONS="AVX512", NUMBA_CPU_NAME="skylake-avx512"),
    ),
    "avx512-bf16": (
        "avx512_bf16",
        dict(ATEN_CPU_CAPABILITY="avx512", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16"),
    ),
    "amx": ("amx_tile", dict(ATEN_CPU_CAPABILITY="avx512", ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX")),
}  # fmt: skip

SCRIPT = """
import json, torch
from graphguard.engine.fidelity import compare, corpus_text, score_text, WINDOW_TOKENS
from graphguard.engine.llm import LLM
from graphguard.engine.models.loader import load_model
text = corpus_text()[:1200]  # within the first window
scores, described = {}, {}
for name, dtype, kernels in (("float32", "float32", "torch"), ("bfloat16", "bfloat16", "torch"),
                             ("q4", "float32", "q4")):
    loaded = load_model(None, dtype=dtype, device="cpu", progress=False)
    llm = LLM(loaded, kernels=kernels, max_model_len=WINDOW_TOKENS, max_num_seqs=2)
    described[name] = llm.engine.kernels.describe()
    scores[name] = score_text(llm.engine, text)
    llm.engine.shutdown()
figures = {name: compare(scores["float32"], scores[name]).as_dict() for name in ("bfloat16", "q4")}
print(json.dumps(dict(figures=figures, described=described)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", list(LEVELS))
def test_the_cpu_paths_stay_within_the_corpus_figures_at_every_level(level: str) -> None:
    flag, env = LEVELS[level]
    if flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag}")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    q4, bf16 = result["figures"]["q4"], result["figures"]["bfloat16"]
    assert q4["positions"] > 240
    # over the whole corpus: q4 KL 0.00044, bfloat16 0.00107 (tests/unit/kernels/test_q4.py)
    assert q4["kl"] < 0.0015 and q4["top1"] > 0.97
    assert bf16["kl"] < 0.005 and bf16["top1"] > 0.93
    # the startup log names what runs: ATen's level first
    aten = env["ATEN_CPU_CAPABILITY"]
    assert f"; {aten}" in result["described"]["q4"], result["described"]
    assert ("amx" in result["described"]["bfloat16"]) == (level == "amx")
    has_bf16 = level in ("avx512-bf16", "amx")
    assert ("avx512-bf16" in result["described"]["bfloat16"]) == has_bf16
