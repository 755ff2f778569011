"""Our paged forward equals transformers' forward (float32, CPU) for both model families."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphguard.engine.models.loader import LoadedModel

# float32 on CPU; the two implementations differ only in the order of float operations.
TOL = {"rtol": 1e-4, "atol": 1e-4}
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks, so that"


def hf_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=["embedded", "tiny_qwen3"])
def pair(request: pytest.FixtureRequest) -> tuple[LoadedModel, Any]:
    """(our model, transformers' model) for one family."""
    if request.param == "embedded":
        return request.getfixturevalue("embedded_model"), request.getfixturevalue("hf_embedded")
    return request.getfixturevalue("tiny_qwen3"), request.getfixturevalue("hf_tiny_qwen3")


def test_prefill_logits_match_transformers(pair: tuple[LoadedModel, Any], paged_driver) -> None:
    loaded, hf_model = pair
    ids = loaded.tokenizer.encode(PROMPT)
    driver = paged_driver(loaded.model)
    logits = driver.prefill([driver.new_table(len(ids))], [ids], [0])
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), **TOL)


def test_prefill_after_a_cached_prefix_matches_transformers(
    pair: tuple[LoadedModel, Any], paged_driver
) -> None:
    loaded, hf_model = pair
    ids = loaded.tokenizer.encode(PROMPT)
    split = len(ids) // 2 + 1  # not a block boundary, so a block is shared by both chunks
    driver = paged_driver(loaded.model)
    table = driver.new_table(len(ids))
    driver.prefill([table], [ids[:split]], [0])
    logits = driver.prefill([table], [ids[split:]], [split])
    torch.testing.assert_close(logits, hf_logits(hf_model, ids)[split:], **TOL)


def test_decode_logits_match_transformers(pair: tuple[LoadedModel, Any], paged_driver) -> None:
    loaded, hf_model = pair
    ids = loaded.tokenizer.encode(PROMPT)
    driver = paged_driver(loaded.model)
    table = driver.new_table(len(ids))
    driver.prefill([table], [ids[:-1]], [0])
    logits = driver.decode([table], [ids[-1]], [len(ids) - 1])
    torch.testing.assert_close(logits[0], hf_logits(hf_model, ids)[-1], **TOL)


def test_tiny_qwen3_loads_as_qwen3_with_qk_norm(tiny_qwen3: LoadedModel) -> None:
    assert tiny_qwen3.config.arch == "qwen3"
    assert hasattr(tiny_qwen3.model.layers[0].self_attn, "q_norm")
