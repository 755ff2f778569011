"""The flags a vLLM user types at `vllm serve`, as `graphguard serve` takes them.

Each is the same flag (graphguard/server/flags.py spells most settings as vLLM does), an alias
of one (`-tp`, `--enable-prefix-caching`, `--dtype half`), accepted because graphguard always
does what it asks (`--enable-chunked-prefill`), taken at the one value graphguard runs
(`--kv-cache-dtype auto`), or refused with the reason. `serve MODEL` takes the model as vLLM's
positional argument. docs/serving.md's flag table is checked against these tables.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's names of the dtypes
DTYPE_ALIASES = {"half": "float16", "bf16": "bfloat16", "float": "float32"}

# a vLLM spelling -> the graphguard flag it is, with the value it sets (None: the flag's own)
ALIASES: dict[str, tuple[str, Any]] = {
    "-tp": ("--tensor-parallel-size", None),
    "--enable-prefix-caching": ("--no-prefix-caching", True),
    "--no-enable-prefix-caching": ("--no-prefix-caching", False),
    "--uvicorn-log-level": ("--log-level", None),
}

# switches graphguard takes because it always does what they ask, and why
ACCEPTED: dict[str, str] = {
    "--enable-auto-tool-choice": "tool_choice auto works whenever a request offers tools",
    "--disable-log-requests": "requests are not logged (nor their prompts)",
    "--disable-log-stats": "no periodic stats are logged; /metrics has them",
    "--enable-chunked-prefill": "long prompts are always prefilled in chunks",
    "--trust-remote-code": "no model code is loaded: Llama and Qwen3 are built in",
    "--disable-frontend-multiprocessing": "the engine steps in its own process regardless",
}


@dataclass(frozen=True)
class OneValue:
    """A vLLM flag graphguard takes only at `value` (what it always runs), else refuses."""

    value: str
    reason: str


# flags taken at the one value graphguard runs
ONE_VALUE: dict[str, OneValue] = {
    "--kv-cache-dtype": OneValue("auto", "the KV cache has the model's dtype"),
    "--pipeline-parallel-size": OneValue("1", "ranks split layers' tensors, not the layers"),
    "--data-parallel-size": OneValue("1", "one engine per server; run servers side by side"),
    "--load-format": OneValue("auto", "weights load from safetensors or GGUF, by the files"),
    "--max-logprobs": OneValue("20", "alternatives per token are at most 20, OpenAI's limit"),
}

# flags taken where they name what graphguard would do anyway, with what that is
SAME_AS_MODEL: dict[str, str] = {
    "--tokenizer": "the model's own tokenizer serves it: only the model's path",
    "--quantization": "weights load in the format of their files: only gguf, for a GGUF model",
}

# flags refused, with the reason
REFUSED: dict[str, str] = {
    "--download-dir": "models load from local folders or .gguf files; nothing is downloaded",
    "--revision": "models load from local folders or .gguf files; nothing is downloaded",
    "--swap-space": "preempted requests recompute their prefix; nothing is swapped to the host",
    "--cpu-offload-gb": "weights stay on the device",
    "--enable-lora": "adapters are served through GraphedCausalLM, not the server",
    "--lora-modules": "adapters are served through GraphedCausalLM, not the server",
    "--speculative-config": "no speculative decoding",
    "--ssl-keyfile": "serve TLS from a proxy in front of the server",
    "--ssl-certfile": "serve TLS from a proxy in front of the server",
}


def dtype_name(text: str) -> str:
    """`--dtype`'s value with vLLM's aliases (half, bf16, float) taken."""
    return DTYPE_ALIASES.get(text, text)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The positional model and vLLM's flags (see module docstring), in their own group."""
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", default=None,
        help="the model, as vLLM's positional argument (the same as --model)",
    )  # fmt: skip
    group = parser.add_argument_group("vLLM's flags (docs/serving.md)")
    for flag, why in ACCEPTED.items():
        group.add_argument(flag, action="store_true", dest=_dest(flag), help=f"accepted: {why}")
    for flag, one in ONE_VALUE.items():
        group.add_argument(
            flag, dest=_dest(flag), metavar=one.value, help=f"only {one.value}: {one.reason}"
        )
    for flag, what in SAME_AS_MODEL.items():
        group.add_argument(flag, dest=_dest(flag), metavar="VALUE", help=what)
    for flag, why in REFUSED.items():
        group.add_argument(
            flag, dest=_dest(flag), nargs="*", metavar="VALUE", help=f"refused: {why}"
        )


def alias_options(flag: str) -> list[str]:
    """vLLM's spellings of graphguard's `flag` that carry no value of their own."""
    return [alias for alias, (target, value) in ALIASES.items() if target == flag and value is None]


def add_prefix_caching_aliases(group: argparse._ArgumentGroup) -> None:
    """vLLM's `--enable-prefix-caching` and `--no-enable-prefix-caching`."""
    for alias, (_, value) in ALIASES.items():
        if isinstance(value, bool):
            action = "store_true" if value else "store_false"
            group.add_argument(alias, dest="prefix_caching", action=action, help=argparse.SUPPRESS)


def checked_vllm_flags(args: argparse.Namespace) -> None:
    """ValueError naming each vLLM flag `args` give that graphguard refuses, with why; the
    positional model moved to `args.model`."""
    problems = []
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model not in (None, tag):
            problems.append(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    for flag, one in ONE_VALUE.items():
        value = getattr(args, _dest(flag), None)
        if value is not None and value != one.value:
            problems.append(f"{flag} {value}: only {one.value} ({one.reason})")
    for flag, why in REFUSED.items():
        if getattr(args, _dest(flag), None) is not None:
            problems.append(f"{flag} is not supported: {why}")
    problems += _not_the_models(args)
    if problems:
        raise ValueError("; ".join(problems))


def _not_the_models(args: argparse.Namespace) -> list[str]:
    """--tokenizer and --quantization where they name what the model is not."""
    problems = []
    tokenizer, quantization = args.vllm_tokenizer, args.vllm_quantization
    model = args.model or "embedded"
    if (
        tokenizer is not None
        and Path(tokenizer).expanduser().resolve() != Path(model).expanduser().resolve()
    ):
        problems.append(f"--tokenizer {tokenizer}: {SAME_AS_MODEL['--tokenizer']} ({model})")
    is_gguf = model == "embedded" or model.endswith(".gguf")
    if quantization is not None and not (quantization == "gguf" and is_gguf):
        problems.append(f"--quantization {quantization}: {SAME_AS_MODEL['--quantization']}")
    return problems


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")
