"""The tokenizer read from a converted folder agrees with transformers' tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from graphguard.engine.models.loader import LoadedModel

TEXTS = ["The capital of France is", "  leading spaces, émojis 🎉 and\nnewlines", "x=1+2"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_model: LoadedModel) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model.folder)


def test_encode_matches_transformers(embedded_model: LoadedModel, hf_tokenizer: Any) -> None:
    for text in TEXTS:
        assert embedded_model.tokenizer.encode(text) == hf_tokenizer.encode(text)


def test_decode_round_trips(embedded_model: LoadedModel) -> None:
    tokenizer = embedded_model.tokenizer
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_matches_transformers(embedded_model: LoadedModel, hf_tokenizer: Any) -> None:
    for messages in CHATS:
        expected = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert embedded_model.tokenizer.render_chat(messages) == expected
        ids = embedded_model.tokenizer.apply_chat_template(messages)
        assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_eos_is_the_end_of_turn_token(embedded_model: LoadedModel) -> None:
    tokenizer = embedded_model.tokenizer
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)


@pytest.mark.parametrize("text", ["日本語のテキスト 🎉 ok", "naïve café\n\ttabs  spaces", "plain"])
def test_token_bytes_rebuild_the_utf8_of_the_text(embedded_model: LoadedModel, text: str) -> None:
    tokenizer = embedded_model.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_special_tokens_are_known_and_spelled_by_their_text(embedded_model: LoadedModel) -> None:
    tokenizer = embedded_model.tokenizer
    eos = tokenizer.eos_token_ids[0]
    assert tokenizer.is_special(eos) and tokenizer.token_bytes(eos) == b"<|im_end|>"
    word = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    assert not tokenizer.is_special(word) and tokenizer.token_bytes(word) == b" Paris"
