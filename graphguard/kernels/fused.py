"""The fused kernel set: Triton kernels for the decoder's norms, RoPE, MLP activation and paged
decode attention; the GEMMs stay cuBLAS (one for q/k/v, one for gate/up, weights concatenated at
load; up to 16 rows, a Triton kernel made for few rows). Everything else, and prefill attention
(SDPA's flash kernels), is the reference's."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from graphguard.kernels import triton_decode, triton_linear, triton_mlp, triton_norm, triton_rope
from graphguard.kernels.reference import HeadShape, QKNorm, TorchKernels


class TritonKernels(TorchKernels):
    """About nine kernels per decoder layer in decode (the reference set launches 30-50)."""

    name = "triton"

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        # NOTE: up to 16 rows (a batch bucket's edge), so an eager batch and the graph's padded
        # one of the same bucket run the same kernel.
        if triton_linear.can_take(x, weight):
            return triton_linear.few_rows_linear(x, weight)
        return F.linear(x, weight)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return triton_norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        return triton_norm.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return triton_mlp.silu_mul(gate_up)

    def rope_qkv(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: HeadShape, qk_norm: QKNorm | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        return triton_rope.rope_qkv(qkv, cos, sin, heads, qk_norm)

    def rope_qkv_write(
        self,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        heads: HeadShape,
        qk_norm: QKNorm | None,
        kv_cache: tuple[Tensor, Tensor],
        slot_mapping: Tensor,
    ) -> Tensor:
        return triton_rope.rope_qkv_write(qkv, cos, sin, heads, qk_norm, kv_cache, slot_mapping)

    def decode_attention(
        self,
        q: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        block_tables: Tensor,
        seq_lens: Tensor,
        scale: float,
    ) -> Tensor:
        return triton_decode.decode_attention(q, kv_cache, block_tables, seq_lens, scale)
