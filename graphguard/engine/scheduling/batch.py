"""What one engine step runs: the scheduler builds it, the model runner and the engine read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from graphguard.engine.scheduling.sequence import Sequence


class PrefillChunk(NamedTuple):
    """The next `num_tokens` uncached tokens of `seq`, prefilled in one step."""

    seq: Sequence
    num_tokens: int
    completes: bool  # the chunk ends the prompt, so the step samples the next token

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> PrefillChunk:
        return cls(seq, num_tokens, seq.num_cached_tokens + num_tokens == seq.num_tokens)


@dataclass
class ScheduledBatch:
    """One step's work. ``seqs`` is the request order in which outputs are returned."""

    decodes: list[Sequence] = field(default_factory=list)  # one query token each
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def prefill_seqs(self) -> list[Sequence]:
        return [chunk.seq for chunk in self.prefills]

    @property
    def chunks(self) -> list[int]:
        """Tokens of each prefill in this step."""
        return [chunk.num_tokens for chunk in self.prefills]

    @property
    def seqs(self) -> list[Sequence]:
        # Decodes were admitted before this step's prefills, so this is admission order.
        return self.decodes + self.prefill_seqs

    @property
    def completes(self) -> list[bool]:
        """Per row of ``seqs``: whether it gets its next token from this step (every decode;
        a prefill whose chunk ends its prompt). Fixed when the batch was scheduled."""
        return [True] * len(self.decodes) + [chunk.completes for chunk in self.prefills]

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
