"""What the masked attention of a grouped prefill costs on a CUDA host: PyTorch's default
attention backend (which picks cuDNN on Hopper) against graphguard's prefill attention (flash,
memory-efficient or math kernels only, K/V heads repeated for the memory-efficient kernel), on
SmolLM2's heads (9 query, 3 K/V, dimension 64) in bf16. For each group shape (sequences x
padded length): the first call (a backend that builds a plan per shape pays it there) and the
mean of 30 later calls, and the largest error against float32 math.

    python bench/prefill_attention.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphguard.engine.models.attention import PREFILL_SDPA_BACKENDS, _masked_sdpa  # noqa: E402

SHAPES = ((12, 16), (16, 16), (7, 9), (10, 32))  # (sequences, padded length) of a group
HEADS, KV_HEADS, DIM, SCALE = 9, 3, 64, 0.125


def timed(call) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def measure(num_seqs: int, length: int, backend: str) -> tuple[float, float, float]:
    """(first call ms, mean of 30 later calls ms, max error against float32)."""
    q = torch.randn(num_seqs, HEADS, length, DIM, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(num_seqs, KV_HEADS, length, DIM, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(num_seqs, 1, length, length, device="cuda", dtype=torch.bool).tril()

    def call() -> torch.Tensor:
        if backend == "graphguard":
            with sdpa_kernel(PREFILL_SDPA_BACKENDS):
                return _masked_sdpa(q, kv, kv, mask, SCALE)
        return F.scaled_dot_product_attention(
            q, kv, kv, attn_mask=mask, scale=SCALE, enable_gqa=True
        )

    first = timed(call)
    steady = timed(lambda: [call() for _ in range(30)]) / 30
    wide = kv.float().repeat_interleave(HEADS // KV_HEADS, dim=1)
    exact = F.scaled_dot_product_attention(q.float(), wide, wide, attn_mask=mask, scale=SCALE)
    return first, steady, (call().float() - exact).abs().max().item()


def main() -> int:
    if not torch.cuda.is_available():
        print("prefill_attention: needs CUDA")
        return 0
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'backend':>10} {'group':>8} {'first ms':>9} {'then ms':>8} {'max err':>8}")
    for backend in ("default", "graphguard"):
        for num_seqs, length in SHAPES:
            first, steady, error = measure(num_seqs, length, backend)
            group = f"{num_seqs}x{length}"
            print(f"{backend:>10} {group:>8} {first:9.1f} {steady:8.3f} {error:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
