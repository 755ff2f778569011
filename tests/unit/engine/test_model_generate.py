"""Greedy decoding through PagedKVStorage, against transformers and the known answers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphguard.engine.models import build_model
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.scheduling.kv import PagedKVStorage
from tests.tiny import tiny_config

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.mark.parametrize(
    ("ours", "reference", "num_new_tokens"),
    [("embedded_model", "hf_embedded", 12), ("tiny_qwen3", "hf_tiny_qwen3", 16)],
)
def test_batched_paged_greedy_matches_transformers_generate(
    request: pytest.FixtureRequest,
    ours: str,
    reference: str,
    num_new_tokens: int,
    paged_driver,
    hf_greedy_fn,
) -> None:
    loaded: LoadedModel = request.getfixturevalue(ours)
    hf_model: Any = request.getfixturevalue(reference)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    outputs = paged_driver(loaded.model).greedy(prompts, num_new_tokens)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy_fn(hf_model, prompt, num_new_tokens)
        assert output[: len(expected)] == expected  # transformers may stop early at eos


def test_capital_of_france_continues_with_paris(embedded_model: LoadedModel, paged_driver) -> None:
    tokenizer = embedded_model.tokenizer
    [output] = paged_driver(embedded_model.model).greedy(
        [tokenizer.encode("The capital of France is")], 3
    )
    assert tokenizer.decode(output).startswith(" Paris.")


def test_chat_answer_names_paris(embedded_model: LoadedModel, paged_driver) -> None:
    tokenizer = embedded_model.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    [output] = paged_driver(embedded_model.model).greedy([prompt], 12)
    end = next(i for i, t in enumerate(output) if t in tokenizer.eos_token_ids)
    assert tokenizer.decode(output[:end]) == "The capital of France is Paris."


TINY_LLAMA = tiny_config(
    vocab_size=97,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(1,),
)


def prefilled_driver(paged_driver) -> tuple[Any, list[list[int]]]:
    model = build_model(TINY_LLAMA, dtype=torch.float32, device="cpu", seed=0)
    driver = paged_driver(model, num_blocks=16)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    tables = [driver.new_table(8) for _ in prompts]
    driver.prefill(tables, prompts, [0, 0])
    return driver, tables


def test_padded_decode_row_leaves_real_rows_and_their_kv_unchanged(paged_driver) -> None:
    plain, tables = prefilled_driver(paged_driver)
    padded, _ = prefilled_driver(paged_driver)
    step = ([3, 4], [5, 2])  # tokens, positions
    expected = plain.decode(tables, *step)
    actual = padded.decode(tables, *step, num_pad_rows=2)
    torch.testing.assert_close(actual[:2], expected, rtol=0, atol=1e-6)
    # NOTE: close, not bitwise: the batch size changes the blocking of the projection matmuls.
    real = slice(PagedKVStorage.DUMMY_BLOCK + 1, None)
    ours_all, reference_all = (
        padded.kv.k_cache + padded.kv.v_cache,
        plain.kv.k_cache + plain.kv.v_cache,
    )
    for ours, reference in zip(ours_all, reference_all, strict=True):
        torch.testing.assert_close(ours[real], reference[real], rtol=0, atol=1e-6)


def test_build_model_with_a_seed_is_reproducible() -> None:
    first = build_model(TINY_LLAMA, dtype=torch.float32, device="cpu", seed=3)
    second = build_model(TINY_LLAMA, dtype=torch.float32, device="cpu", seed=3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
