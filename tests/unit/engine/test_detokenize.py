"""Incremental detokenization and stop strings, with the embedded model's real tokenizer."""

from __future__ import annotations

import pytest

from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.detokenize import IncrementalDetokenizer
from graphguard.engine.tokens.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture
def tokenizer(embedded_model: LoadedModel) -> Tokenizer:
    return embedded_model.tokenizer


MIXED_TEXT = " Hello wörld, naïve café 你好 🎉🙂 done."


def _stream(
    tokenizer: Tokenizer, text: str, stop: tuple[str, ...] = (), prompt: str = "Say:"
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``text`` token by token; return the detokenizer and the non-final deltas."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), stop)
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        detokenizer.add_token(token_id)
        deltas.append(detokenizer.take_delta(is_final=False))
        if detokenizer.is_stopped:
            break
    return detokenizer, deltas


def test_deltas_add_up_to_the_full_decode(tokenizer: Tokenizer) -> None:
    detokenizer, deltas = _stream(tokenizer, MIXED_TEXT)
    assert "".join(deltas) == MIXED_TEXT == detokenizer.text


def test_no_delta_carries_half_a_character(tokenizer: Tokenizer) -> None:
    _, deltas = _stream(tokenizer, MIXED_TEXT)
    assert not any("\ufffd" in delta for delta in deltas)


def test_first_token_keeps_its_leading_space(tokenizer: Tokenizer) -> None:
    _, deltas = _stream(tokenizer, " Paris", prompt="The capital of France is")
    assert deltas[0].startswith(" ")


def test_stop_string_ends_the_text_before_it(tokenizer: Tokenizer) -> None:
    detokenizer, _ = _stream(tokenizer, " one two three four", stop=(" three",))
    assert detokenizer.is_stopped
    assert detokenizer.take_delta(is_final=True) == ""
    assert detokenizer.text == " one two"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    detokenizer, _ = _stream(tokenizer, " a, b. c", stop=(".", ","))
    detokenizer.take_delta(is_final=True)
    assert detokenizer.text == " a"


def test_a_possible_stop_prefix_is_held_back_until_decided(tokenizer: Tokenizer) -> None:
    detokenizer, deltas = _stream(tokenizer, " x END", stop=(" ENDING",))
    assert "".join(deltas) == " x"  # " END" could still become " ENDING"
    assert detokenizer.take_delta(is_final=True) == " END"
    assert not detokenizer.is_stopped


def test_tokens_after_a_stop_are_ignored(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [1], stop=("b",))
    for token_id in tokenizer.encode("ab cd", add_special_tokens=False):
        detokenizer.add_token(token_id)
    assert detokenizer.take_delta(is_final=True) == "a"
