"""Building blocks shared by the Llama-family decoders: RMSNorm, RoPE, GQA attention, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphguard.engine.attention import AttentionMetadata, paged_attention
from graphguard.engine.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as the reference models do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (default, unscaled): cos/sin ``[T, head_dim]`` per position."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)

    def _compute_inv_freq(self) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute inv_freq (float32, on CPU first) after the module was built on meta."""
        self.inv_freq = self._compute_inv_freq().to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # NOTE: angles stay float32 whatever the model dtype; only cos/sin are cast.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [T, H, D]`` by per-token cos/sin ``[T, D]`` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class GQAAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=False)

    def normalize_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Hook for families that normalize q/k per head before RoPE (identity here)."""
        return q, k

    def project_qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x ``[T, hidden]`` -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, RoPE applied."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.normalize_qk(q, k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def project_out(self, out: Tensor) -> Tensor:
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        return self.project_out(paged_attention(q, k, v, k_cache, v_cache, meta, self.scale))


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Names follow the HF checkpoints."""

    def __init__(self, config: ModelConfig, self_attn: GQAAttention) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return self.mlp_block(h)

    # The two halves around attention, for pipelines that run attention between graphs.
    def pre_attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.self_attn.project_qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: Tensor, out: Tensor) -> Tensor:
        return self.mlp_block(x + self.self_attn.project_out(out))

    def mlp_block(self, h: Tensor) -> Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))
