"""bench/tiny_model.py writes a model graphguard serves: the embedded model's tokenizer and
vocabulary, two small layers, the same weights each time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bench.tiny_model import write_tiny_model
from graphguard.engine.llm import LLM
from graphguard.engine.tokens.sampling import SamplingParams

pytestmark = pytest.mark.slow  # converts the embedded model when no earlier test has


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_tiny_model_loads_generates_and_is_written_the_same_twice(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "a")
    write_tiny_model(tmp_path / "b")

    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 64)
    weights = [_digest(tmp_path / name / "model.safetensors") for name in ("a", "b")]
    assert weights[0] == weights[1]
    llm = LLM(str(tmp_path / "a"), device="cpu")
    try:
        assert llm.engine.tokenizer.vocab_size == config["vocab_size"] == 49152
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        (output,) = llm.generate(["Hello there"], params, use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()


def test_the_tiny_model_refuses_a_folder_with_files_in_it(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"old")
    with pytest.raises(SystemExit, match="not empty"):
        write_tiny_model(tmp_path)
