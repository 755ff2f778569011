"""The fused kernel set: Triton kernels for the decoder's norms, RoPE, MLP activation and paged
decode and prefill attention; the GEMMs stay cuBLAS (one for q/k/v, one for gate/up, weights
concatenated at load; 2-16 rows, a Triton kernel made for few rows; one row, a Triton GEMV).
Short prefills run their attention as decode rows (graphguard/engine/shapes.py
`prefills_as_rows`); a packed prefill's attention is one varlen launch over the paged cache
(`triton_prefill.py`); everything else is the reference's."""

from __future__ import annotations

import os
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from graphguard.kernels import (
    launch,
    triton_decode,
    triton_linear,
    triton_mlp,
    triton_norm,
    triton_prefill,
    triton_rope,
)
from graphguard.kernels.reference import TorchKernels

# GRAPHGUARD_GEMM_PROLOGUES=1: a norm and the GEMM it feeds, and SiLU-and-multiply and the down
# projection, each one kernel in a few-rows step (docs/kernels.md); off: one stream at 30k
# decoded at 245 tok/s with it and 401 without on an H100 (run 93).
PROLOGUES_ENV = "GRAPHGUARD_GEMM_PROLOGUES"
# GRAPHGUARD_SPLIT_K=1: the few-rows GEMM splits K where a weight has few output features
# (triton_linear.plan_linear); off: on an H200 it kept the graphs' parity but added nothing to
# dependent launches (one stream at 30k: 502 tok/s with both, 504 without it; run 94).
SPLIT_K_ENV = "GRAPHGUARD_SPLIT_K"
# GRAPHGUARD_ONE_ROW=0: a batch of one through the few-rows GEMM (the matrix unit, rows padded to
# 16) instead of `one_row_linear`: for side-by-side runs (docs/kernels.md).
ONE_ROW_ENV = "GRAPHGUARD_ONE_ROW"
# GRAPHGUARD_WHOLE_PREFILL=0: packed prefills in segments with eager attention between them, as
# the reference set's run, instead of whole graphs (docs/segmented.md): for side-by-side runs.
WHOLE_PREFILL_ENV = "GRAPHGUARD_WHOLE_PREFILL"


class TritonKernels(TorchKernels):
    """Nine kernels per decoder layer in decode (the reference set launches 50-67)."""

    name = "triton"
    # A prefill whose tokens x longest context is at most 512 x 2,048 runs as decode-attention
    # rows: each row walks only its own context, one launch per layer.
    row_prefill_area = 512 * 2048
    needs_prefill_groups = False  # one launch attends every sequence of a packed prefill

    def __init__(self) -> None:
        self._has_prefill_tiles = False  # both of the prefill kernel's tile sets compiled
        self.gemm_prologues = os.environ.get(PROLOGUES_ENV, "0") == "1"
        self.split_k = os.environ.get(SPLIT_K_ENV, "0") == "1"
        self.one_row = os.environ.get(ONE_ROW_ENV, "1") != "0"
        # the prefill attention reads the metadata's device tensors alone (triton_prefill.py)
        self.whole_prefill_graphs = os.environ.get(WHOLE_PREFILL_ENV, "1") != "0"

    def opt_ins(self) -> tuple[str, ...]:
        asked = (
            (f"{PROLOGUES_ENV}=1", self.gemm_prologues),
            (f"{SPLIT_K_ENV}=1", self.split_k),
            (f"{launch.PDL_ENV}=0", not launch.asked_for()),
            (f"{ONE_ROW_ENV}=0", not self.one_row),
            (f"{WHOLE_PREFILL_ENV}=0", not self.whole_prefill_graphs),
        )
        return tuple(name for name, on in asked if on)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        # NOTE: up to 16 rows (a batch bucket's edge), so an eager batch and the graph's padded
        # one of the same bucket run the same kernel; one row (a bucket of its own) the one-row
        # GEMM: one stream at 30k decoded at 626 tok/s with it, 545 without (run 103).
        if triton_linear.can_take(x, weight):
            if self.one_row and x.shape[0] == 1:  # no matrix unit, no rows of padding
                return triton_linear.one_row_linear(x, weight)
            plan = triton_linear.plan_linear(x.shape[1], weight.shape[0], split=self.split_k)
            return triton_linear.few_rows_linear(x, weight, plan)
        return F.linear(x, weight)

    def norm_linear(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor
    ) -> tuple[Tensor, Tensor]:
        if self.gemm_prologues and triton_linear.can_take(x, weight):
            return triton_linear.few_rows_norm_linear(x, residual, norm_weight, eps, weight)
        return super().norm_linear(x, residual, norm_weight, eps, weight)

    def silu_linear(self, gate_up: Tensor, weight: Tensor) -> Tensor:
        if self.gemm_prologues and triton_linear.can_take(gate_up, weight):
            return triton_linear.few_rows_silu_linear(gate_up, weight)
        return super().silu_linear(gate_up, weight)

    # The fused kernels take the reference methods' arguments (graphguard/kernels/reference.py).
    rms_norm = staticmethod(triton_norm.rms_norm)
    add_rms_norm = staticmethod(triton_norm.add_rms_norm)
    silu_mul = staticmethod(triton_mlp.silu_mul)
    rope_qkv = staticmethod(triton_rope.rope_qkv)
    rope_qkv_write = staticmethod(triton_rope.rope_qkv_write)
    decode_attention = staticmethod(triton_decode.decode_attention)

    def prefill_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        meta: Any,
        scale: float,
    ) -> Tensor:
        # NOTE: the first call (the engine's warm-up prefill) compiles both of the kernel's tile
        # sets; k and v are read where they were written, in the cache: no gather, no mask.
        if not self._has_prefill_tiles:
            triton_prefill.compile_tiles(q.shape[1], kv_cache)
            self._has_prefill_tiles = True
        return triton_prefill.prefill_attention(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )
