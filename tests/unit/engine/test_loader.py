"""Loading: sources, the GGUF conversion cache, Hugging Face config parsing."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from graphguard.engine.config import PRESETS
from graphguard.engine.models.loader import (
    LoadedModel,
    config_from_hf,
    config_to_hf,
    embedded_gguf_path,
    load_model,
)
from graphguard.engine.models.weights_cache import atomic_folder, cache_root, source_cache_folder


def same_weights(a: LoadedModel, b: LoadedModel) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_embedded_model_has_the_smollm2_shape(embedded_model: LoadedModel) -> None:
    # The GGUF stores eps as float32 (9.9999997e-06); every other field is exact.
    eps = embedded_model.config.rms_norm_eps
    assert embedded_model.config == replace(PRESETS["smollm2-135m"], rms_norm_eps=eps)
    assert eps == pytest.approx(1e-5)


def test_second_embedded_load_reads_the_cache_with_identical_weights(
    embedded_model: LoadedModel,
) -> None:
    again = load_model("embedded", progress=False)
    assert again.load_path == "gguf-cache"
    assert same_weights(again, embedded_model)


@pytest.mark.slow
def test_first_gguf_load_converts_then_later_loads_use_the_cache(
    embedded_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAPHGUARD_CACHE_DIR", str(tmp_path))
    first = load_model(None, progress=False)
    second = load_model(None, progress=False)
    assert (first.load_path, second.load_path) == ("gguf", "gguf-cache")
    assert second.folder is not None and second.folder.parent.parent == tmp_path
    assert same_weights(first, second) and same_weights(first, embedded_model)


def test_gguf_file_path_takes_the_gguf_route(embedded_model: LoadedModel) -> None:
    loaded = load_model(str(embedded_gguf_path()), progress=False)
    assert loaded.load_path == "gguf-cache"  # the embedded load converted the same file
    assert loaded.name == embedded_gguf_path().stem
    assert loaded.folder == embedded_model.folder


def test_hf_folder_load_reports_its_path(tiny_qwen3: LoadedModel, tiny_qwen3_folder: Path) -> None:
    assert tiny_qwen3.load_path == "hf-folder"
    assert tiny_qwen3.folder == tiny_qwen3_folder


def test_bfloat16_load_keeps_the_requested_dtype(tiny_qwen3_folder: Path) -> None:
    loaded = load_model(str(tiny_qwen3_folder), dtype="bfloat16", progress=False)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.rotary.inv_freq.dtype == torch.float32


def test_unknown_source_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing.gguf"), progress=False)


def test_hf_config_round_trips_for_every_preset() -> None:
    for preset in PRESETS.values():
        assert config_from_hf(config_to_hf(preset)) == preset


def test_scaled_rope_checkpoints_are_refused() -> None:
    hf = config_to_hf(PRESETS["smollm2-135m"])
    hf["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    with pytest.raises(NotImplementedError, match="rope_type"):
        config_from_hf(hf)


def test_cache_root_prefers_the_explicit_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    monkeypatch.setenv("GRAPHGUARD_CACHE_DIR", "/explicit")
    assert cache_root() == Path("/explicit")
    monkeypatch.delenv("GRAPHGUARD_CACHE_DIR")
    assert cache_root() == Path("/xdg/graphguard")


def test_failed_cache_write_leaves_no_folder(tmp_path: Path) -> None:
    final = tmp_path / "models" / "entry"
    with pytest.raises(RuntimeError), atomic_folder(final) as scratch:
        (scratch / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")
    assert not final.exists()
    assert list(final.parent.iterdir()) == []


def test_the_converted_model_cache_is_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    first, second, other = (tmp_path / name for name in ("a", "b", "c"))
    for folder in (first, second, other):
        folder.mkdir()
    (first / "m.gguf").write_bytes(b"the same weights")
    (second / "m.gguf").write_bytes(b"the same weights")  # a second install of one file
    os.utime(second / "m.gguf", ns=(1, 1))
    (other / "m.gguf").write_bytes(b"other weights!!!")  # same size, other bytes
    a, b, c = (source_cache_folder(f / "m.gguf") for f in (first, second, other))
    assert a == b and a != c
    assert a.parent == tmp_path / "cache" / "models"
    # a file that changed (its mtime with it) is read and keyed again
    (first / "m.gguf").write_bytes(b"changed weights!")
    assert source_cache_folder(first / "m.gguf") not in (a, c)
