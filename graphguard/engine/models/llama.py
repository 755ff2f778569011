"""Llama (and SmolLM2): the plain pre-norm GQA decoder."""

from __future__ import annotations

from graphguard.engine.config import ModelConfig
from graphguard.engine.models import DecoderModel
from graphguard.engine.models.layers import DecoderLayer, GQAAttention


class LlamaModel(DecoderModel):
    """Llama decoder: RoPE GQA attention and a SwiGLU MLP in every layer."""

    def make_layer(self, config: ModelConfig) -> DecoderLayer:
        return DecoderLayer(config, GQAAttention(config))
