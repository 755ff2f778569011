"""Token names and text offsets of logprobs (graphguard.server.formatting.TokenTexts)."""

from __future__ import annotations

from graphguard.server.formatting import TokenTexts, token_name


class PieceTokenizer:
    """Token ids mapped to their bytes; ids >= 100 are control tokens."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id >= 100


def offsets(texts: TokenTexts, ids: list[int], num_prompt: int) -> list[tuple[str, int]]:
    return [texts.add(token_id, i < num_prompt) for i, token_id in enumerate(ids)]


def test_a_stripped_leading_space_and_an_added_start_token_keep_offsets_on_the_text() -> None:
    # SentencePiece spells "The cat" as " The", " cat" and decodes it without the first space;
    # the start token was added by encoding, so the echoed text does not spell it.
    tokenizer = PieceTokenizer({100: b"<s>", 1: b" The", 2: b" cat", 3: b" sat"})
    texts = TokenTexts(tokenizer, echo="The cat")  # type: ignore[arg-type]
    assert offsets(texts, [100, 1, 2, 3], num_prompt=3) == [
        ("<s>", 0), (" The", 0), (" cat", 3), (" sat", 7)
    ]  # fmt: skip


def test_control_tokens_spelled_in_a_prompt_advance_and_generated_ones_do_not() -> None:
    tokenizer = PieceTokenizer({101: b"<|im_start|>", 102: b"<|im_end|>", 1: b"hi", 2: b"!"})
    texts = TokenTexts(tokenizer, echo="<|im_start|>hi")  # type: ignore[arg-type]
    assert offsets(texts, [101, 1, 2, 102], num_prompt=2) == [
        ("<|im_start|>", 0), ("hi", 12), ("!", 14), ("<|im_end|>", 15)
    ]  # fmt: skip


def test_a_split_character_counts_from_the_token_that_completes_it() -> None:
    snowman = "☃".encode()  # three bytes
    tokenizer = PieceTokenizer({1: snowman[:2], 2: snowman[2:], 3: b"x"})
    texts = TokenTexts(tokenizer)  # type: ignore[arg-type]
    assert offsets(texts, [1, 2, 3], num_prompt=0) == [
        ("bytes:\\xe2\\x98", 0), ("bytes:\\x83", 0), ("x", 1)
    ]  # fmt: skip
    assert token_name("é".encode()) == "é"
