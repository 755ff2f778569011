"""Tiny transformers causal LMs of the families graphguard.hf is tested on, for the CPU tests
(tests/unit) and the CUDA ones (tests/gpu) alike.

Besides Llama and Qwen3, the families are chosen for the ways a decoder step differs: sliding
windows (a Python int beside the cache's device counter), alternating layer types, fused
projections, extra scaling multipliers, post-norms, layers without RoPE, and mixture-of-experts
blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """A transformers family: its config and model classes, the config fields that give it its
    trait (`window`: the sliding window, filled within a test's tokens), and the trait."""

    config: str
    model: str
    trait: str
    fields: dict[str, Any] = field(default_factory=dict)
    window: bool = False


FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "the reference decoder"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "q/k norms"),
    "mistral": Family("MistralConfig", "MistralForCausalLM", "sliding windows", window=True),
    "qwen3_sliding": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        "sliding windows on some layers",
        {"use_sliding_window": True, "max_window_layers": 1},
        window=True,
    ),  # fmt: skip
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "alternating layer types, post-norms, soft-capping, a scaled embedding",
        window=True,
    ),  # fmt: skip
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", "fused q/k/v and gate/up projections"),
    "granite": Family(
        "GraniteConfig",
        "GraniteForCausalLM",
        "embedding, residual, attention and logit scales",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 4.0,
        },
    ),  # fmt: skip
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", "post-norms, q/k norms over all heads"),
    "smollm3": Family(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        "layers without RoPE",
        {"no_rope_layer_interval": 2},
    ),  # fmt: skip
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "mixture-of-experts blocks",
        {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1},
    ),  # fmt: skip
}
# the families beyond the two the rest of the tests use
OTHER_FAMILIES = [name for name in FAMILIES if name not in ("llama", "qwen3")]


def tiny_causal_lm(
    family: str,
    shape: dict[str, Any],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> Any:
    """A model of `family` (FAMILIES) of `shape`, random weights from seed 0, in eval mode, with
    no end-of-sequence token, so that every row generates all its tokens; `window` is the
    sliding window of a family that has one (default: a quarter of the positions)."""
    import transformers

    spec = FAMILIES[family]
    fields = dict(shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, **spec.fields)
    if spec.window:
        fields["sliding_window"] = window or shape["max_position_embeddings"] // 16
    if family == "qwen3_moe":
        fields["moe_intermediate_size"] = shape["intermediate_size"] // 4
    config = getattr(transformers, spec.config)(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, spec.model)(config)
    model = model.to(dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model
