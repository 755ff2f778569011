"""A tiny decoder config shared by tests that need a model but not the embedded one."""

from __future__ import annotations

import dataclasses
from typing import Any

from graphguard.engine.config import ModelConfig

_TINY = ModelConfig(
    arch="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def tiny_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """Two layers of width 32: Llama by default; Qwen3 (q/k norm, untied head) on request."""
    family = {"arch": arch, "tie_word_embeddings": arch == "llama"}
    return dataclasses.replace(_TINY, **{**family, **overrides})
