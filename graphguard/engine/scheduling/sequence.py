"""Per-request state: tokens, KV blocks, scheduling status and how the request ended."""

from __future__ import annotations

import enum

import torch

from graphguard.engine.tokens.logits import RequestLogits
from graphguard.engine.tokens.sampling import SamplingParams, TokenLogprob
from graphguard.engine.tokens.structured import TokenMatcher


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold the KV of ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request as the scheduler sees it.

    Invariant: while RUNNING, the KV of the first ``num_cached_tokens`` tokens is written in
    ``block_table``; the last token (just sampled) is not yet cached and is the next query.

    ``forks`` are siblings (choices of one request with n > 1) waiting on this sequence's
    prefill: they hold no KV of their own until it completes, then each starts from its
    prompt's KV (graphguard.engine.scheduling.scheduler) and samples its first token from the same
    logits. While this sequence is admitted, each fork's ``block_table`` holds the block
    reserved for its copy of the prompt's partly filled last block (if there is one).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # the prompt as int64 bytes, from the engine's intake: what the prefix cache hashes
        self.prompt_bytes: bytes | None = None
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator = generator  # None: draws come from torch's default generator
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or token that ended it
        # Image input: embeddings [len(image_positions), hidden] replace the input embeddings
        # of the prompt tokens at image_positions during prefill (graphguard.engine.models.vision).
        self.image_embeds: torch.Tensor | None = None
        self.image_positions: list[int] = []
        # params.prompt_logprobs: one entry per prompt token (None for the first), written by
        # the prefill chunk by chunk; handed out once, with the request's first output.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_logprobs_sent = False
        self.grammar: TokenMatcher | None = None  # params.response_format's place, if any
        # params' bias, bans and penalties as tensors (graphguard.engine.tokens.logits)
        self.logit_changes: RequestLogits | None = None
        self.forks: list[Sequence] = []
        self.prefix_hashes: list[
            bytes
        ] = []  # of its full blocks, as far as computed (prefix_cache)
        # the pool's prefix_generation when it was admitted (-1: never): its KV is cached only
        # while that generation lasts (new weights start another)
        self.cache_generation = -1

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def has_prompt_logprobs(self) -> bool:
        """Every prompt token is scored (a prefill has passed the prompt's end)."""
        scored = self.prompt_logprobs
        return scored is not None and len(scored) == self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_running(self) -> bool:
        return self.status is SequenceStatus.RUNNING

    @property
    def group_size(self) -> int:
        """Running slots this sequence takes once its forks have started: itself and them."""
        return 1 + len(self.forks)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token; every earlier token now has its KV written, and the
        grammar (if any) has moved past it."""
        self.num_cached_tokens = self.num_tokens
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
