"""Tiny transformers causal LMs of the two families graphguard.hf is tested on, for the CPU
tests (tests/unit) and the CUDA ones (tests/gpu) alike."""

from __future__ import annotations

from typing import Any

import torch


def tiny_causal_lm(
    family: str, shape: dict[str, Any], *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Any:
    """A Qwen3 (`family` "qwen3") or Llama model of `shape`, random weights from seed 0, in
    eval mode, with no end-of-sequence token, so that every row generates all its tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = (
        (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config_class(**shape))
    model = model.to(dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model
