"""Linear layers of a few rows: a Triton kernel for the decode step's small batches.

At batch 1-16 a decoder GEMM reads its weight once and does almost no arithmetic; cuBLAS runs it
on a handful of 8x64 tiles (15 thread blocks for SmolLM2's q/k/v), so latency, not bandwidth,
sets its time. Here every program owns BLOCK_N output features for all rows (rows padded to 16
for the matrix unit) and walks the full K in one fixed order: many more programs in flight, and
a result that does not depend on the batch it came in (each row is computed alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 16  # rows the kernel takes; more go to cuBLAS
BLOCK_N = 16  # output features per program
BLOCK_K = 128


@triton.jit
def _few_rows_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    num_out,
    stride_x,
    stride_w,
    NUM_IN: tl.constexpr,  # a model dimension: few values, one compile each
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    is_col, is_row = cols < num_out, rows < num_rows
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for first in range(0, NUM_IN, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        is_k = ks < NUM_IN
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=is_row[:, None] & is_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
            mask=is_col[:, None] & is_k[None, :],
            other=0.0,
        )
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    dest = out_ptr + rows[:, None] * num_out + cols[None, :]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


def can_take(x: Tensor, weight: Tensor) -> bool:
    """Whether `few_rows_linear` takes this call: 1-16 rows, unit-stride rows and weight."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and x.dtype == weight.dtype
    )


def few_rows_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [M, K] @ weight[N, K].T`` for M <= MAX_ROWS, float32 accumulation."""
    if not can_take(x, weight):
        raise ValueError(f"few_rows_linear takes 1-{MAX_ROWS} unit-stride rows: {x.shape}")
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    out = x.new_empty((num_rows, num_out))
    _few_rows_kernel[(triton.cdiv(num_out, BLOCK_N),)](
        x, weight, out, num_rows, num_out, x.stride(0), weight.stride(0),
        NUM_IN=num_in, ROWS=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
