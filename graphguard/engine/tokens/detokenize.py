"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and for
tokenizers whose leading spaces depend on the previous token, so each new token is decoded
together with a short window of the tokens before it and only the text that window adds is
emitted. Text that could be the start of a stop string is held back until it is decided.

Stop strings are matched incrementally (StopMatcher): each new character advances one matcher
state per stop string, so a step's work is its new text times the number of stop strings, never
the text so far or the stop strings' length.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as left context, so the first output token decodes with its real spacing.
NUM_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Decoder(Protocol):
    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool | None = None,
    ) -> str: ...


class StopMatcher:
    """Where stop strings complete in a growing text, fed a piece at a time.

    Per stop string it keeps how much of it the text so far ends with (a Knuth-Morris-Pratt
    automaton: the failure table, built once, says how far a partial match falls back on a
    mismatch), so a character costs amortized O(1) per stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self._fallback = [_failure_table(s) for s in stop]
        self._matched = [0] * len(stop)  # per stop string: how much of it the text ends with

    def feed(self, text: str, start: int) -> tuple[int, int, str] | None:
        """Take `text[start:]`, the new part of the text; where the earliest stop string that
        completes in it begins and ends, and which it is, if any."""
        found: tuple[int, int, str] | None = None
        for end in range(start, len(text)):
            char = text[end]
            for i, stop in enumerate(self._stop):
                matched = self._matched[i]
                while matched and stop[matched] != char:
                    matched = self._fallback[i][matched - 1]
                if stop[matched] == char:
                    matched += 1
                if matched == len(stop):
                    begin = end + 1 - matched
                    if found is None or begin < found[0]:
                        found = (begin, end + 1, stop)
                    matched = self._fallback[i][matched - 1]
                self._matched[i] = matched
        return found

    @property
    def held_back(self) -> int:
        """How many characters at the end of the text could still begin a stop string."""
        return max(self._matched, default=0)


def _failure_table(pattern: str) -> list[int]:
    """For each prefix of `pattern`, the length of its longest proper prefix that is also its
    suffix (where a partial match goes on after a mismatch)."""
    table = [0] * len(pattern)
    matched = 0
    for i in range(1, len(pattern)):
        while matched and pattern[i] != pattern[matched]:
            matched = table[matched - 1]
        if pattern[i] == pattern[matched]:
            matched += 1
        table[i] = matched
    return table


class IncrementalDetokenizer:
    """Turns a growing stream of output token ids into text deltas; applies stop strings.

    `include_stop` keeps a stop string that ends the text in it; `skip_special_tokens` and
    `spaces_between_special_tokens` are the tokenizer's decode options."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(self._ids)  # tokens before this are already in self._text
        self._stops = StopMatcher(stop)
        self._include_stop = include_stop
        self._decode_options = _decode_options(skip_special_tokens, spaces_between_special_tokens)
        self._text = ""  # decoded output text, cut at a stop string once one is seen
        self._num_emitted_chars = 0
        self.is_stopped = False  # a stop string was found; the request must finish
        self.stop_string: str | None = None  # which one

    @property
    def text(self) -> str:
        """The text emitted so far (the sum of all deltas)."""
        return self._text[: self._num_emitted_chars]

    def add_token(self, token_id: int, may_stop: bool = True) -> None:
        """Decode one more output token; sets ``is_stopped`` when a stop string completes in
        its text (one that completes while not `may_stop`, before min_tokens, ends nothing)."""
        if self.is_stopped:
            return
        self._ids.append(token_id)
        delta = self._decode_new_text()
        if delta:
            num_old_chars = len(self._text)
            self._text += delta
            found = self._stops.feed(self._text, num_old_chars)
            if found is not None and may_stop:
                self._text = self._text[: found[1] if self._include_stop else found[0]]
                self.is_stopped, self.stop_string = True, found[2]

    def take_delta(self, is_final: bool) -> str:
        """Text not yet emitted; a possible stop-string prefix is kept back unless final."""
        end = len(self._text)
        if not is_final and not self.is_stopped:
            end -= self._stops.held_back
        delta = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return delta

    def _decode_new_text(self) -> str:
        window = self._ids[self._prefix_offset :]
        decode, options = self._tokenizer.decode, self._decode_options
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], **options)
        full_text = decode(window, **options)
        # Wait for more tokens while the last character is still an incomplete byte sequence.
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


def _decode_options(skip_special_tokens: bool, spaces_between: bool) -> dict[str, bool]:
    """The decode keywords (the joining of special tokens matters only where they are kept)."""
    options = {"skip_special_tokens": skip_special_tokens}
    if not skip_special_tokens:
        options["spaces_between_special_tokens"] = spaces_between
    return options
