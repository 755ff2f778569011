"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from graphguard.engine.config import ModelConfig
from graphguard.engine.models import DecoderModel
from graphguard.engine.models.layers import DecoderLayer, GQAAttention, RMSNorm
from graphguard.kernels import QKNorm


class Qwen3Attention(GQAAttention):
    """GQA attention whose q and k are RMS-normalized per head (weights shared across heads)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qk_norm(self) -> QKNorm:
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class Qwen3Model(DecoderModel):
    """Qwen3 dense decoder."""

    def make_layer(self, config: ModelConfig) -> DecoderLayer:
        return DecoderLayer(config, Qwen3Attention(config))
