"""vLLM's arguments of the offline API, as graphguard takes them: `LLM(...)`'s keywords mapped to
the engine's settings (or refused with the reason), and `generate`'s prompts in every form vLLM
accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's dtype names -> graphguard's
DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "fp32": "float32",
}
# vLLM's keyword -> the engine setting it is
RENAMED = {
    "enable_prefix_caching": "prefix_caching",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_model_len": "max_model_len",
    "tensor_parallel_size": "tensor_parallel_size",
    "enforce_eager": "enforce_eager",
    "block_size": "block_size",
    "seed": "seed",
    "gpu_memory_utilization": "gpu_memory_utilization",
}
# vLLM's keywords accepted at the value that asks for nothing, and why anything else is not
REFUSED = {
    "trust_remote_code": (False, "graphguard runs no code from a model's repository"),
    "quantization": (None, "quantized weights are not served on this path yet"),
    "lora_request": (None, "LoRA adapters are not served"),
    "pipeline_parallel_size": (1, "pipeline parallelism is not implemented"),
    "tokenizer_mode": ("auto", "the tokenizer is the model's tokenizer.json"),
}


def engine_settings(vllm: dict[str, Any]) -> dict[str, Any]:
    """The engine's settings of vLLM's keywords (EngineConfig fields and graph settings pass
    as they are); ValueError for one refused with its reason."""
    settings: dict[str, Any] = {}
    for name, value in vllm.items():
        if name in REFUSED:
            off, why = REFUSED[name]
            if value != off:
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        elif name == "dtype":
            if value not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {value!r}")
            settings["dtype"] = DTYPES[value]
        elif name in RENAMED:
            settings[RENAMED[name]] = value
        else:
            settings[name] = value
    return settings


@dataclass(frozen=True)
class Prompt:
    """One prompt of a generate call: its text (None where it came as token ids) and its
    token ids (None until the text is encoded)."""

    text: str | None
    token_ids: list[int] | None


def prompts_of(prompts: Any) -> list[Prompt]:
    """`generate`'s prompts: a string, `{"prompt": text}`, `{"prompt_token_ids": ids}`, or a
    list of them; TypeError for anything else (before a request runs)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise TypeError(
            "prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', or a "
            f"non-empty list of them; got {type(prompts).__name__}"
        )
    return [_one(prompt) for prompt in prompts]


def _one(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if not isinstance(prompt, dict):
        raise TypeError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - {"prompt", "prompt_token_ids"}
    if unknown:
        raise TypeError(
            f"prompt keys {sorted(unknown)} are not supported (multi_modal_data: images go "
            "through the server's chat endpoint)"
        )
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise TypeError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"'prompt' must be a string, got {type(text).__name__}")
    if ids is not None and (
        not isinstance(ids, (list, tuple)) or any(type(t) is not int for t in ids)
    ):
        raise TypeError("'prompt_token_ids' must be a list of integers")
    return Prompt(text, None if ids is None else list(ids))
