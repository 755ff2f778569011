"""What a step gives back for each request: its sampled token, why it finished, its text.

`sample_rows` samples a step's rows together and, if that raises, row by row, so that an error
one request's parameters cause ends that request alone. `finish_reason` and `build_output`
turn a sampled token into the request's `RequestOutput` (detokenized delta, logprobs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from graphguard.engine.scheduling.sequence import Sequence
from graphguard.engine.tokens.detokenize import IncrementalDetokenizer
from graphguard.engine.tokens.logits import adjusted
from graphguard.engine.tokens.sampling import TokenLogprob, sample, token_logprobs

log = logging.getLogger("graphguard")


@dataclass
class RequestOutput:
    """What one step produced for one request (``new_token_ids`` is empty for an abort)."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    text: str  # all text so far: the sum of the deltas
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    # One per new token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token (None for the first), in the request's first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # why the engine ended this request on its own (finish "abort")
    # what ended a "stop": the stop string, or the stop token id (None: end-of-sequence)
    stop_reason: int | str | None = None


def sample_rows(
    logits: torch.Tensor, seqs: list[Sequence]
) -> list[tuple[int, TokenLogprob | None] | Exception]:
    """Each row's (token, logprob), sampled for the whole batch at once; if that raises,
    row by row, so that an error one request's parameters cause is that request's alone.

    NOTE: a batch that raised may have advanced the generators of the rows drawn before
    the error; those rows still get a proper draw, from the next state of their stream.
    """
    try:
        return list(zip(*_sample(logits, seqs), strict=True))
    except Exception:  # noqa: BLE001 - found per row below
        log.warning("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
    picked: list[tuple[int, TokenLogprob | None] | Exception] = []
    for row, seq in enumerate(seqs):
        try:
            ((token_id, logprob),) = zip(*_sample(logits[row : row + 1], [seq]), strict=True)
            picked.append((token_id, logprob))
        except Exception as exc:  # noqa: BLE001 - this request's error: it ends it
            picked.append(exc)
    return picked


def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[Any]]:
    params = [s.params for s in seqs]
    allowed = [None if s.grammar is None else s.grammar.allowed_tokens() for s in seqs]
    changed = adjusted(logits, [s.logit_changes for s in seqs], [s.output_token_ids for s in seqs])
    token_ids = sample(changed, params, [s.generator for s in seqs], allowed)
    # NOTE: log probabilities are the model's own, before the request's changes
    return token_ids, token_logprobs(logits, token_ids, [p.logprobs for p in params])


def finish_reason(
    seq: Sequence,
    token_id: int,
    detokenizer: IncrementalDetokenizer,
    eos_token_ids: Any,
    max_model_len: int,
) -> str | None:
    """Why `seq` ends with `token_id` (appended already), or None; feeds the detokenizer."""
    ends = not seq.params.ignore_eos and token_id in eos_token_ids
    if ends or token_id in seq.params.stop_token_ids:
        # an end of sequence: its text is left out unless include_stop_str_in_output keeps it
        # (seen only where skip_special_tokens is off, as a special token's text is skipped)
        if seq.params.include_stop_str_in_output:
            detokenizer.add_token(token_id, may_stop=False)
        if not ends:
            seq.stop_reason = token_id
        return "stop"
    detokenizer.add_token(token_id, may_stop=seq.num_output_tokens >= seq.params.min_tokens)
    if detokenizer.is_stopped:
        seq.stop_reason = detokenizer.stop_string
        return "stop"
    if seq.grammar is not None and seq.grammar.is_finished:
        return "stop"  # the end of the response_format's document
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def build_output(
    seq: Sequence,
    detokenizer: IncrementalDetokenizer,
    new_token_ids: list[int],
    logprobs: list[TokenLogprob] | None = None,
) -> RequestOutput:
    """The request's output for this step: the text its new tokens add (all of what is left
    once it finished), and its prompt logprobs the first time they are ready."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=new_token_ids,
        delta_text=detokenizer.take_delta(is_final=seq.is_finished),
        text=detokenizer.text,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        logprobs=logprobs,
        prompt_logprobs=_take_prompt_logprobs(seq),
        stop_reason=seq.stop_reason,
    )


def _take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
    if not seq.has_prompt_logprobs or seq.prompt_logprobs_sent:
        return None
    seq.prompt_logprobs_sent = True
    return seq.prompt_logprobs
