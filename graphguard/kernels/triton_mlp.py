"""SiLU-and-multiply of the SwiGLU MLP in one kernel: the fused gate/up GEMM's output in, or a
model's separate gate and up projections."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphguard.kernels.launch import follow_previous, launch_flags

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, width, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    follow_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * width + cols, (silu * up.to(tl.float32)).to(up.dtype), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``[T, 2 I]`` (gate, then up) -> ``silu(gate) * up`` ``[T, I]``, computed in float32."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul expects [T, 2 * I] rows, got {tuple(gate_up.shape)}")
    width = gate_up.shape[1] // 2
    return _launch(gate_up, gate_up[:, width:], width)


def silu_mul_pair(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of two ``[T, I]`` row sets, computed in float32."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"silu_mul_pair expects two [T, I] rows, got {gate.shape}, {up.shape}")
    return _launch(gate, up, gate.shape[1])


def _launch(gate: Tensor, up: Tensor, width: int) -> Tensor:
    num_rows = gate.shape[0]
    out = torch.empty(num_rows, width, dtype=up.dtype, device=up.device)
    if num_rows:
        grid = (num_rows, triton.cdiv(width, BLOCK))
        _silu_mul_kernel[grid](
            gate, up, out, gate.stride(0), up.stride(0), width, BLOCK=BLOCK, num_warps=4,
            **launch_flags(up.device),
        )  # fmt: skip
    return out
