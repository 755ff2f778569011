"""What the offline API returns, in vLLM's shapes: a RequestOutput per prompt, a CompletionOutput
per choice, and log probabilities as one `{token id: Logprob}` dict per token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from graphguard.engine.tokens.sampling import TokenLogprob


@dataclass
class Logprob:
    """One token's log probability, its rank in the model's distribution (1: the likeliest;
    None where it is not among the alternatives asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # the chosen token and its alternatives, by token id


@dataclass
class CompletionOutput:
    """One choice of a prompt. `cumulative_logprob` is the sum of its tokens' log
    probabilities where they were asked for (`logprobs`); `stop_reason` is the stop string or
    stop token id that ended it (None for end-of-sequence or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result: its text (None where it came as token ids), its token ids, its
    prompt log probabilities (None for the first token) where asked for, and its choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def logprob_dicts(
    logprobs: list[TokenLogprob] | None, decode: Callable[[int], str]
) -> list[TokenLogprobs] | None:
    """The engine's log probabilities of generated tokens as vLLM gives them."""
    return None if logprobs is None else [_one(lp, decode) for lp in logprobs]


def prompt_logprob_dicts(
    logprobs: list[TokenLogprob | None] | None, decode: Callable[[int], str]
) -> list[TokenLogprobs | None] | None:
    """The same of a prompt's tokens (None for the first, which nothing predicts)."""
    if logprobs is None:
        return None
    return [None if lp is None else _one(lp, decode) for lp in logprobs]


def _one(lp: TokenLogprob, decode: Callable[[int], str]) -> TokenLogprobs:
    ranks = {token_id: rank for rank, (token_id, _) in enumerate(lp.top, start=1)}
    found = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), decode(lp.token_id))}
    for token_id, value in lp.top:
        found.setdefault(token_id, Logprob(value, ranks[token_id], decode(token_id)))
    return found
