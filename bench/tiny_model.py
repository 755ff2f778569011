"""A random Llama with the embedded model's vocabulary, tokenizer and chat template, small enough
(2 layers, hidden size 64) that a CPU decode step costs little beside the serving stack around
it: the CPU stand-in for the serving benches, whose figures are then about the server and the
load, not the model.

    python bench/tiny_model.py /tmp/tinyllama
    python bench/serve_load.py --model-path /tmp/tinyllama --clients 2 --concurrency 32 ...

The weights are seeded, so a folder written twice is the same.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphguard.engine.models.loader import embedded_gguf_path, gguf_to_folder  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_tiny_model(folder: Path, num_layers: int = 2, hidden_size: int = 64) -> None:
    """Write the tiny model into `folder`, new or empty."""
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder} is not empty: name a new folder")
    embedded, _ = gguf_to_folder(embedded_gguf_path(), progress=False)
    source = json.loads((embedded / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=source["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": source.get("rope_theta", 1e5), "rope_type": "default"},
        bos_token_id=source["bos_token_id"],
        eos_token_id=source["eos_token_id"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    folder.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # seeded here, not for the caller
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (embedded / name).exists():
            shutil.copy(embedded / name, folder / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    args = parser.parse_args(argv)
    write_tiny_model(args.folder, args.num_layers, args.hidden_size)
    print(f"wrote {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
