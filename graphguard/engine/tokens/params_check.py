"""SamplingParams' check: every field's value is one the engine can honour, or a ValueError that
names the field (InvalidParamError where the server's error names another parameter)."""

from __future__ import annotations

import math
import struct
from typing import Any

from graphguard.engine.tokens.limits import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)
from graphguard.engine.tokens.structured import InvalidParamError, ResponseFormat

# a SamplingParams: sampling.py imports this module, so it is not named here (no cycle)
SamplingParams = Any


def validate_params(params: SamplingParams) -> None:
    """Raise InvalidParamError (a ValueError) naming the first field whose value cannot be
    honoured, in its message and as its `param`."""
    try:
        _check_numbers(params)
        _check_counts(params)
        _check_stops(params)
        _check_tokens(params)
    except InvalidParamError:
        raise
    except ValueError as exc:  # each message begins with the field's name
        name = str(exc).split(" ", 1)[0]
        raise InvalidParamError(name, str(exc)) from None
    if params.response_format is not None and not isinstance(
        params.response_format, ResponseFormat
    ):
        raise InvalidParamError("response_format", "response_format must be a ResponseFormat")


def _check_numbers(p: SamplingParams) -> None:
    """Temperature, the filters and the penalties."""
    names = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty")  # fmt: skip
    for name in names:
        value = getattr(p, name)
        if not _is_number(value) or math.isnan(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if not 0.0 <= p.temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {p.temperature!r}")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p!r}")
    if _as_float32(p.top_p) == 0.0:
        # the sampler compares in float32, where this top_p would keep no token at all
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p!r} (0 in float32)")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= getattr(p, name) <= MAX_PENALTY:
            raise ValueError(
                f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(p, name)!r}"
            )
    if not MIN_REPETITION_PENALTY <= p.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise ValueError(
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
            f"{MAX_REPETITION_PENALTY:g}], got {p.repetition_penalty!r}"
        )


def _check_counts(p: SamplingParams) -> None:
    """max_tokens, min_tokens, n, top_k, logprob counts, the seed, truncation."""
    if not _is_int(p.max_tokens) or p.max_tokens < 0:
        raise ValueError(
            f"max_tokens must be an integer >= 0 (0: prefill and score the prompt only), "
            f"got {p.max_tokens!r}"
        )
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
        raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {p.min_tokens!r}")
    if not _is_int(p.n) or p.n < 1:
        raise ValueError(f"n must be an integer >= 1, got {p.n!r}")
    if not _is_int(p.top_k) or p.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {p.top_k!r}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise ValueError(
                f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
            )
    if p.seed is not None and (not _is_int(p.seed) or not -(2**63) <= p.seed < 2**63):
        raise ValueError(f"seed must be None or fit a signed 64-bit integer, got {p.seed!r}")
    truncate = p.truncate_prompt_tokens
    if truncate is not None and (not _is_int(truncate) or truncate < 1):
        raise ValueError(f"truncate_prompt_tokens must be None or >= 1, got {truncate!r}")
    if p.cache_salt is not None and (not isinstance(p.cache_salt, str) or not p.cache_salt):
        raise ValueError(f"cache_salt must be None or a non-empty string, got {p.cache_salt!r}")
    for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens"):  # fmt: skip
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a boolean, got {getattr(p, name)!r}")


def _check_stops(p: SamplingParams) -> None:
    """Stop strings (bounded in number and length) and bad words."""
    for name, most in (("stop", MAX_STOP_STRINGS), ("bad_words", MAX_BAD_WORDS)):
        values = getattr(p, name)
        if not isinstance(values, tuple) or any(not isinstance(s, str) or not s for s in values):
            raise ValueError(f"{name} must be non-empty strings, got {values!r}")
        if len(values) > most:
            raise ValueError(f"{name} has {len(values)} strings; at most {most} are allowed")
    num_chars = sum(len(s) for s in p.stop)
    if num_chars > MAX_STOP_CHARS:
        raise ValueError(
            f"stop has {num_chars} characters in all; at most {MAX_STOP_CHARS} are allowed"
        )


def _check_tokens(p: SamplingParams) -> None:
    """Token ids: stop_token_ids, allowed_token_ids, logit_bias."""
    if any(not _is_int(t) or t < 0 for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids >= 0, got {p.stop_token_ids!r}")
    allowed = p.allowed_token_ids
    if allowed is not None and (not allowed or any(not _is_int(t) or t < 0 for t in allowed)):
        raise ValueError(
            f"allowed_token_ids must be None or token ids >= 0 (at least one), got {allowed!r}"
        )
    token_ids = [token_id for token_id, _ in p.logit_bias]
    if any(not _is_int(t) or t < 0 for t in token_ids) or len(set(token_ids)) != len(token_ids):
        raise InvalidParamError("logit_bias", "logit_bias keys must be distinct token ids >= 0")
    for token_id, bias in p.logit_bias:
        if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidParamError(
                "logit_bias",
                f"logit_bias of token {token_id} must be a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}",
            )


def check_token_range(p: SamplingParams, vocab_size: int) -> None:
    """ValueError for a token id the model does not have (the engine knows the vocabulary)."""
    for name in ("stop_token_ids", "allowed_token_ids"):
        values = getattr(p, name) or ()
        if any(t >= vocab_size for t in values):
            raise ValueError(f"{name} must be token ids below the vocabulary's {vocab_size}")
    if any(token_id >= vocab_size for token_id, _ in p.logit_bias):
        raise InvalidParamError(
            "logit_bias", f"logit_bias keys must be token ids below the vocabulary's {vocab_size}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_float32(value: float) -> float:
    """`value` rounded to float32, as the sampler holds it (a tensor would cost the server's
    event loop about 20 us a request)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])
