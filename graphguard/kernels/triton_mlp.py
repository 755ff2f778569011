"""SiLU-and-multiply of the SwiGLU MLP: the fused gate/up GEMM's output in, one kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * width + cols, (silu * up.to(tl.float32)).to(up.dtype), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``[T, 2 I]`` (gate, then up) -> ``silu(gate) * up`` ``[T, I]``, computed in float32."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul expects [T, 2 * I] rows, got {tuple(gate_up.shape)}")
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        grid = (num_rows, triton.cdiv(width, BLOCK))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), width, BLOCK=BLOCK, num_warps=4)
    return out
