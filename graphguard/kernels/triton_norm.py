"""RMSNorm, and the residual add fused with it, as one Triton kernel per call.

One program normalizes one row. The sum is rounded to the model dtype before it is normalized
and stored as the next residual, as the unfused ``x + residual`` would be; statistics are
float32, and the normalized row is cast back before it is scaled, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphguard.kernels.launch import follow_previous, launch_flags


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * num_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / num_cols + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * num_cols + cols, (weight * normed).to(x.dtype), mask=mask)


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, ...]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm expects rows [T, hidden] with unit stride, got {x.shape}")
    num_rows, num_cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    summed = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(num_cols)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,
            summed,
            weight,
            out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            num_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **launch_flags(x.device),
        )
    return out, summed


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of rows ``[T, hidden]`` (or ``[T, H, D]`` heads, normalized per head)."""
    rows = x.reshape(-1, x.shape[-1])
    return _launch(rows, None, weight, eps)[0].view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` -> (rms_norm(h), h), in one pass over the rows."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    out, summed = _launch(x, residual, weight, eps)
    return out, summed
