"""What a request does to its logits before it picks a token, built once when it is added.

`RequestLogits.build` turns a request's SamplingParams into tensors on the model's device: its
bias (ids and values), the tokens it may pick (`allowed_token_ids`), the one-token bad words,
the multi-token bad words (a prefix, then the banned token), and the tokens that would end it
too early (end-of-sequence and `stop_token_ids`, banned until `min_tokens`). Its penalties keep
their counts as tensors updated with each new token, so a step's work is the request's new
tokens and one pass over the vocabulary, never its output so far (a bias rebuilt from Python
data every step cost 84 ms a step for a whole-vocabulary bias).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from graphguard.engine.tokens.sampling import SamplingParams


@dataclass
class RequestLogits:
    """One request's changes to its logits (see module docstring)."""

    params: SamplingParams
    bias: tuple[Tensor, Tensor] | None = None  # (token ids, biases)
    allowed: Tensor | None = None  # bool [vocab]: the only tokens it may pick
    banned: Tensor | None = None  # token ids it may never pick (one-token bad words)
    bad_sequences: tuple[tuple[tuple[int, ...], int], ...] = ()  # (tokens before, banned one)
    ending: Tensor | None = None  # token ids that end it, banned until min_tokens are out
    counts: Tensor | None = None  # float [vocab]: how often it generated each token
    seen: Tensor | None = None  # bool [vocab]: tokens of its prompt or output (repetition)
    device: torch.device = torch.device("cpu")
    _num_counted: int = field(default=0, repr=False)  # output tokens in counts and seen

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
        encode: Callable[[str], list[int]],
    ) -> RequestLogits | None:
        """The request's changes, or None where it makes none."""
        if not params.adjusts_logits:
            return None
        made = cls(params, device=device)
        ids = _on(device)
        if params.logit_bias:
            token_ids, biases = zip(*params.logit_bias, strict=True)
            made.bias = ids(token_ids), torch.tensor(biases, dtype=torch.float32, device=device)
        if params.allowed_token_ids is not None:
            made.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            made.allowed[ids(params.allowed_token_ids)] = True
        words = bad_word_sequences(params.bad_words, encode)
        single = [word[0] for word in words if len(word) == 1]
        made.banned = ids(single) if single else None
        made.bad_sequences = tuple((word[:-1], word[-1]) for word in words if len(word) > 1)
        if params.min_tokens:
            made.ending = ids([*eos_token_ids, *params.stop_token_ids])
        if params.presence_penalty or params.frequency_penalty:
            made.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            made.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            made.seen[ids(prompt_token_ids)] = True
        return made

    def apply(self, row: Tensor, output_token_ids: Sequence[int]) -> None:
        """Change one row of float32 logits [vocab] in place (a copy of the model's)."""
        self._count(output_token_ids)
        if self.bias is not None:
            row.index_add_(0, *self.bias)
        if self.allowed is not None:
            row.masked_fill_(~self.allowed, -torch.inf)
        if self.banned is not None:
            row[self.banned] = -torch.inf
        for before, token in self.bad_sequences:
            if tuple(output_token_ids[len(output_token_ids) - len(before) :]) == before:
                row[token] = -torch.inf
        if self.ending is not None and len(output_token_ids) < self.params.min_tokens:
            row[self.ending] = -torch.inf
        self._penalize(row)

    def _count(self, output_token_ids: Sequence[int]) -> None:
        """Count the output tokens since the last step (a preempted request's outputs stay)."""
        new = output_token_ids[self._num_counted :]
        self._num_counted = len(output_token_ids)
        if not new or (self.counts is None and self.seen is None):
            return
        index = torch.tensor(list(new), device=self.device)
        if self.counts is not None:
            self.counts.index_add_(0, index, torch.ones(len(new), device=self.device))
        if self.seen is not None:
            self.seen[index] = True

    def _penalize(self, row: Tensor) -> None:
        p = self.params
        if self.seen is not None:
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(self.seen, penalized, row))
        if self.counts is not None:
            row -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0)


def bad_word_sequences(
    words: Sequence[str], encode: Callable[[str], list[int]]
) -> list[tuple[int, ...]]:
    """The token sequences of each bad word, alone and after a space (as it reads within a
    text), distinct."""
    found: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word.lstrip(" ")):
            ids = tuple(encode(text))
            if ids and ids not in found:
                found.append(ids)
    return found


def _on(device: torch.device) -> Callable[[Sequence[int]], Tensor]:
    return lambda values: torch.tensor(list(values), dtype=torch.long, device=device)


def adjusted(
    logits: Tensor,
    adjust: Sequence[RequestLogits | None],
    output_token_ids: Sequence[Sequence[int]],
) -> Tensor:
    """float32 logits with each row's changes (a copy where any row has some)."""
    rows = [i for i, a in enumerate(adjust) if a is not None]
    if not rows:
        return logits
    logits = logits.to(torch.float32, copy=True)
    for i in rows:
        changes = adjust[i]
        assert changes is not None
        changes.apply(logits[i], output_token_ids[i])
    return logits
