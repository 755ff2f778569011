"""Stop strings matched incrementally (graphguard/engine/tokens/detokenize.py StopMatcher): the
same answers as searching the whole text, at a cost that grows with the new text only."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from graphguard.engine.tokens.detokenize import StopMatcher

ALPHABET = "ab "
texts = st.text(alphabet=ALPHABET, max_size=40)
stops = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4)


def first_stop(text: str, stop: list[str]) -> tuple[int, int] | None:
    """The reference: the earliest-ending stop string in `text`, the earliest-beginning among
    those ending at the same place (what feeding one character at a time finds)."""
    for end in range(1, len(text) + 1):
        begins = [end - len(s) for s in stop if text[:end].endswith(s)]
        if begins:
            return min(begins), end
    return None


@settings(max_examples=300, deadline=None)
@given(text=texts, stop=stops)
def test_fed_a_character_at_a_time_it_finds_what_a_search_finds(text, stop):
    matcher = StopMatcher(tuple(stop))
    found = None
    for end in range(len(text)):
        found = matcher.feed(text[: end + 1], end)
        if found is not None:
            break
    assert (found and found[:2]) == (first_stop(text, stop) or None)


@settings(max_examples=300, deadline=None)
@given(text=texts, stop=stops)
def test_what_it_holds_back_is_the_longest_tail_that_begins_a_stop_string(text, stop):
    matcher = StopMatcher(tuple(stop))
    if matcher.feed(text, 0) is not None:
        return
    longest = max(
        (size for s in stop for size in range(1, len(s)) if text.endswith(s[:size])), default=0
    )
    assert matcher.held_back == longest


def test_a_long_stop_string_costs_each_step_its_new_text_only():
    matcher = StopMatcher(("z" * 200_000,))
    text, started = "", time.perf_counter()
    for _ in range(2_000):
        text += "#" * 80
        assert matcher.feed(text, len(text) - 80) is None
    per_step = (time.perf_counter() - started) / 2_000
    assert per_step < 1e-3 and matcher.held_back == 0
