"""The instruction sets the CPU kernels run with: what PyTorch and oneDNN pick on this machine.

PyTorch's own CPU kernels (elementwise ops, the 4-bit and 8-bit GEMMs) are compiled for a few
levels and pick one at start (``avx512``, ``avx2`` or ``default``; `ATEN_CPU_CAPABILITY` caps
it). oneDNN, behind the float GEMMs, uses what the CPU has up to `ONEDNN_MAX_CPU_ISA`:
bfloat16 dot products (AVX-512 BF16) and AMX tiles change how a bfloat16 GEMM rounds, so they
are named too. Both variables are read once when a process starts; the test suite runs the CPU
paths under each level the machine has (tests/unit/kernels/test_isa_levels.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# oneDNN's levels, lowest first (its documented ONEDNN_MAX_CPU_ISA values that matter here)
_ONEDNN_ORDER = (
    *("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"),
    *("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "ALL"),
)
# a feature oneDNN uses -> (the /proc/cpuinfo flag that shows it, the lowest level that allows it)
_ONEDNN_FEATURES = {
    "avx512-bf16": ("avx512_bf16", "AVX512_CORE_BF16"),
    "amx": ("amx_tile", "AVX512_CORE_AMX"),
}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_features(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """What the CPU kernels use here: ATen's level, then the oneDNN features the CPU has and
    ONEDNN_MAX_CPU_ISA allows (e.g. ``("avx512", "avx512-bf16", "amx")``)."""
    flags = cpu_flags() if flags is None else flags
    features = [torch.backends.cpu.get_cpu_capability().lower()]
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    allowed = _ONEDNN_ORDER.index(cap) if cap in _ONEDNN_ORDER else len(_ONEDNN_ORDER) - 1
    for name, (flag, level) in _ONEDNN_FEATURES.items():
        if flag in flags and _ONEDNN_ORDER.index(level) <= allowed:
            features.append(name)
    return tuple(features)
