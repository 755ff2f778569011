"""Building blocks shared by the Llama-family decoders: RMSNorm, RoPE, GQA attention, SwiGLU.

Every op goes through the engine's kernel set (graphguard/kernels): the plain PyTorch one, or
the fused Triton one on CUDA. q/k/v and gate/up each run as one GEMM: their weights are
concatenated once the model is on its device (`fuse_projections`), and the checkpoint-named
parameters become views of the concatenation, so an in-place ``load_state_dict`` (a weight
reload) updates what the GEMM reads. The residual stream is carried between layers unadded,
so each residual add is fused with the norm after it.

Submodules are called through their ``forward``: the engine registers no module hooks, and a
``module(...)`` call costs 2-4 us more on a CPU, where a 4-bit decode step makes 150 of them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from graphguard.engine.config import ModelConfig
from graphguard.engine.models.attention import AttentionMetadata
from graphguard.kernels import HeadShape, QKNorm, TorchKernels
from graphguard.kernels.reference import rms_norm, write_kv

Rope = tuple[Tensor, Tensor]  # cos, sin [T, head_dim], model dtype


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as the reference models do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (default, unscaled): cos/sin ``[T, head_dim]`` per position.

    With `build_table`, cos/sin of every position are computed once (by the same ops, on the
    same device, so the values are the same bits) and a step gathers its rows in one kernel
    instead of computing them in seven.
    """

    inv_freq: Tensor
    table: Tensor | None  # [max_positions, 2, head_dim] cos then sin, model dtype, or None

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)
        self.register_buffer("table", None, persistent=False)

    def _compute_inv_freq(self) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute inv_freq (float32, on CPU first) after the module was built on meta."""
        self.inv_freq = self._compute_inv_freq().to(device)

    def build_table(self, max_positions: int, dtype: torch.dtype) -> None:
        """Precompute cos/sin of positions ``[0, max_positions)`` in `dtype`."""
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        self.table = torch.stack(self.compute(positions, dtype), dim=1)

    def compute(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        # NOTE: angles stay float32 whatever the model dtype; only cos/sin are cast.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        table = self.table
        if table is None or table.dtype != dtype:
            return self.compute(positions, dtype)
        rows = table.index_select(0, positions)  # [T, 2, head_dim]
        return rows[:, 0], rows[:, 1]


class Linear(nn.Linear):
    """nn.Linear without bias whose GEMM is the kernel set's when one is given (a row-parallel
    shard's subclass, graphguard/engine/parallel, all-reduces after it)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor, kernels: TorchKernels | None = None) -> Tensor:
        if kernels is None:
            return self.reduce(torch.nn.functional.linear(x, self.weight))
        return self.reduce(kernels.linear(x, self.weight))

    def forward_gated(self, gate_up: Tensor, kernels: TorchKernels) -> Tensor:
        """This layer over ``silu(gate) * up`` of rows ``[T, 2 I]`` (one kernel where the set
        fuses them: `silu_linear`)."""
        return self.reduce(kernels.silu_linear(gate_up, self.weight))

    def reduce(self, out: Tensor) -> Tensor:
        """The layer's output from its GEMM's (a row-parallel shard sums its ranks')."""
        return out


def fuse_linears(*linears: nn.Linear) -> Tensor:
    """One weight ``[sum(out), in]`` for linears that read the same input; each linear's weight
    becomes a view of its rows (so copying into it updates the fused weight)."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class GQAAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache: the weights, and the block from
    its fused q/k/v rows on (`attend`; DecoderLayer computes those rows with its norm)."""

    qkv_weight: Tensor | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = HeadShape(config.num_heads, config.num_kv_heads, config.head_dim)
        self.scale = config.head_dim**-0.5
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.o_proj = Linear(q_dim, config.hidden_size)
        self.qkv_weight = None  # set by fuse()

    def fuse(self) -> None:
        """Concatenate the q/k/v weights (once the weights are on their device)."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def qk_norm(self) -> QKNorm | None:
        """Per-head q/k norm weights for families that norm q and k before RoPE (None here)."""
        return None

    def fused_qkv_weight(self) -> Tensor:
        """The q/k/v weights as one ``[(Hq + 2 Hkv) * D, hidden]``."""
        if self.qkv_weight is None:
            raise RuntimeError("fuse() the model's projections before running it")
        return self.qkv_weight

    def rope(self, qkv: Tensor, rope: Rope, kernels: TorchKernels) -> tuple[Tensor, Tensor, Tensor]:
        """Fused q/k/v rows -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, RoPE applied."""
        return kernels.rope_qkv(qkv, *rope, self.heads, self.qk_norm())

    def project_out(self, out: Tensor, kernels: TorchKernels) -> Tensor:
        return self.o_proj.forward(out.reshape(out.shape[0], -1), kernels)

    def attend(
        self,
        qkv: Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: tuple[Tensor, Tensor],
        kernels: TorchKernels,
    ) -> Tensor:
        """The attention block from its fused q/k/v rows on: RoPE, the K/V write, attention
        and o_proj."""
        if meta.packed:
            q, k, v = self.rope(qkv, rope, kernels)
            write_kv(*kv_cache, k, v, meta.slot_mapping)
            out = kernels.prefill_attention(q, k, v, kv_cache, meta, self.scale)
        else:
            out = kernels.attend_decode(
                qkv, rope, self.heads, self.qk_norm(), kv_cache,
                meta.slot_mapping, meta.block_tables, meta.seq_lens, self.scale,
            )  # fmt: skip
        return self.project_out(out, kernels)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one GEMM: the weights (DecoderLayer's
    `mlp_block` runs them with the norm before)."""

    gate_up_weight: Tensor | None

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.gate_up_weight = None  # set by fuse()

    def fuse(self) -> None:
        """Concatenate the gate/up weights (once the weights are on their device)."""
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def fused_gate_up_weight(self) -> Tensor:
        """The gate/up weights as one ``[2 I, hidden]``."""
        if self.gate_up_weight is None:
            raise RuntimeError("fuse() the model's projections before running it")
        return self.gate_up_weight


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Names follow the HF checkpoints.

    The layer takes the previous layer's output and the residual stream separately and returns
    its MLP output and the new residual: ``(h, residual) -> (mlp_out, residual + attn_out)``,
    where the first layer has no residual yet.
    """

    def __init__(self, config: ModelConfig, self_attn: GQAAttention) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: Tensor,
        residual: Tensor | None,
        rope: Rope,
        meta: AttentionMetadata,
        kv_cache: tuple[Tensor, Tensor],
        kernels: TorchKernels,
    ) -> tuple[Tensor, Tensor]:
        qkv, residual = self.norm_qkv(h, residual, kernels)
        attn_out = self.self_attn.attend(qkv, rope, meta, kv_cache, kernels)
        return self.mlp_block(attn_out, residual, kernels)

    def norm_qkv(
        self, h: Tensor, residual: Tensor | None, kernels: TorchKernels
    ) -> tuple[Tensor, Tensor]:
        """(the fused q/k/v rows of input_layernorm(h + residual), h + residual); the first
        layer's residual is h. One kernel where the set fuses the norm into the GEMM."""
        norm = self.input_layernorm
        weight = self.self_attn.fused_qkv_weight()
        return kernels.norm_linear(h, residual, norm.weight, norm.eps, weight)

    def mlp_block(
        self, attn_out: Tensor, residual: Tensor, kernels: TorchKernels
    ) -> tuple[Tensor, Tensor]:
        """The attention output added to the residual, normed, through the MLP."""
        norm = self.post_attention_layernorm
        weight = self.mlp.fused_gate_up_weight()
        gate_up, residual = kernels.norm_linear(attn_out, residual, norm.weight, norm.eps, weight)
        return self.mlp.down_proj.forward_gated(gate_up, kernels), residual
