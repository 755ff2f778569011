"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
tokenizers whose leading spaces depend on the previous token, so each new token is decoded
together with a short window of the tokens before it and only the text that window adds is
emitted. Text that could be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as left context, so the first output token decodes with its real spacing.
NUM_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing stream of output token ids into text deltas; applies stop strings."""

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(self._ids)  # tokens before this are already in self._text
        self._stop = stop
        self._text = ""  # decoded output text, cut at a stop string once one is seen
        self._num_emitted_chars = 0
        self.is_stopped = False  # a stop string was found; the request must finish

    @property
    def text(self) -> str:
        """The text emitted so far (the sum of all deltas)."""
        return self._text[: self._num_emitted_chars]

    def add_token(self, token_id: int) -> None:
        """Decode one more output token; sets ``is_stopped`` when a stop string completes."""
        if self.is_stopped:
            return
        self._ids.append(token_id)
        delta = self._decode_new_text()
        if delta:
            num_old_chars = len(self._text)
            self._text += delta
            self._apply_stop(num_old_chars)

    def take_delta(self, is_final: bool) -> str:
        """Text not yet emitted; a possible stop-string prefix is kept back unless final."""
        end = len(self._text)
        if not is_final:
            end -= _held_back_chars(self._text, self._stop)
        delta = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return delta

    def _decode_new_text(self) -> str:
        window = self._ids[self._prefix_offset :]
        prefix_text = self._tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full_text = self._tokenizer.decode(window, skip_special_tokens=True)
        # Wait for more tokens while the last character is still an incomplete byte sequence.
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _apply_stop(self, num_old_chars: int) -> None:
        if not self._stop:
            return
        max_stop_chars = max(len(s) for s in self._stop)
        search_from = max(0, num_old_chars - max_stop_chars + 1)
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            # The stop string itself is not part of the output.
            self._text = self._text[: min(hits)]
            self.is_stopped = True


def _held_back_chars(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stop:
        for size in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:size]):
                longest = size
                break
    return longest
