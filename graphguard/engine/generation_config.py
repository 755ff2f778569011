"""A model's own sampling defaults (`generation_config.json`), applied as vLLM applies them.

vLLM's `--generation-config`: "auto" reads the model folder's `generation_config.json`, "vllm"
ignores it, and a folder reads that folder's. The fields vLLM takes from it become the defaults
of every request that does not set them itself: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as max_tokens. Its other fields (do_sample among them)
are not sampling defaults there, nor here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json's name of a field -> SamplingParams'
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
CHOICES = ("auto", "vllm")


def generation_defaults(choice: str, model_folder: Path | str | None) -> dict[str, Any]:
    """SamplingParams defaults of `choice` ("auto", "vllm" or a folder) for the model in
    `model_folder` (None: the model has no folder, so no file); ValueError for a folder that
    is not one, or a file that is no JSON object."""
    if choice == "vllm":
        return {}
    folder = model_folder if choice == "auto" else Path(choice)
    if choice != "auto" and not Path(choice).is_dir():
        raise ValueError(f"--generation-config: {choice!r} is neither auto, vllm nor a folder")
    if folder is None:
        return {}
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults = {
        ours: data[theirs] for theirs, ours in FIELDS.items() if data.get(theirs) is not None
    }
    if defaults.get("top_k", 0) < 0:
        defaults["top_k"] = 0  # transformers' and vLLM's -1: off
    return defaults
