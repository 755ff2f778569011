"""The `prompt` of /v1/completions: text, token ids, or a list of either, one prompt each."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from graphguard.server.fields import TOKEN_ID_BOUND, valid_unicode, whole_number

# Prompts one /v1/completions request may carry, each its own engine request and choice; room
# for evaluation harnesses' batches (lm-eval's `batch_size`) without one request flooding the queue.
MAX_PROMPTS_PER_REQUEST = 64

Prompt = str | list[int]  # one completions prompt: text, or token ids
_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[
    list[Annotated[int, Field(ge=0, json_schema_extra=TOKEN_ID_BOUND)]], Field(min_length=1)
]
_Batch = Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
# What `prompt` accepts, as the OpenAPI document states it (`completion_prompts` checks it).
PromptInput = (
    _Text | _TokenIds | Annotated[list[_Text], _Batch] | Annotated[list[_TokenIds], _Batch]
)


def _is_token_ids(value: Any) -> bool:
    # NOTE: `type(t) is int`: JSON true and false arrive as bool, a subclass of int.
    return isinstance(value, list) and all(type(t) is int for t in value)


def _whole_token_ids(prompt: Any) -> Any:
    """`prompt` with token ids written as numbers with no fraction (4790.0) made ints."""
    if not isinstance(prompt, list):
        return prompt
    if all(type(t) in (int, float) for t in prompt):
        return [whole_number(t) for t in prompt]
    return [_whole_token_ids(p) if isinstance(p, list) else p for p in prompt]


def completion_prompts(prompt: Any) -> list[Prompt]:
    """The prompts a completions `prompt` holds, in order: text or a list of token ids is one
    prompt, a list of texts or of token-id lists one per item. ValueError for an empty list or
    prompt, a list that mixes the kinds, a token id with a fraction, more than
    MAX_PROMPTS_PER_REQUEST prompts, or text that is not valid Unicode. (Token ids are checked
    against the vocabulary by the handler.)"""
    prompt = _whole_token_ids(prompt)
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)
    ):
        prompts = prompt
    else:
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists (integers), with no mixing of strings and token ids"
        )
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise ValueError(
            f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompts)}"
        )
    for index, one in enumerate(prompts):
        _check_prompt(one, f"prompt {index}" if len(prompts) > 1 else "prompt")
    return prompts


def _check_prompt(prompt: Prompt, where: str) -> None:
    if not prompt:
        raise ValueError(f"{where} must not be empty")
    if isinstance(prompt, str):
        try:
            valid_unicode(prompt)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
