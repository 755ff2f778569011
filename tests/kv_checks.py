"""Which KV slots a decode step may write, and which it did (for the padding tests)."""

from __future__ import annotations

import torch

from graphguard.engine.engine import LLMEngine


def last_decode_slots(engine: LLMEngine) -> set[int]:
    """The slots the running sequences wrote in the decode step just run.

    A decode step writes the K/V of each sequence's previous last token, and then appends one
    token: after the step that position is num_tokens - 2.
    """
    block_size = engine.kv.block_size
    slots = set()
    for seq in engine.scheduler.running:
        position = seq.num_tokens - 2
        slots.add(seq.block_table[position // block_size] * block_size + position % block_size)
    return slots


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """Slots (block * block_size + offset) whose K or V changed in any layer."""
    changed: set[int] = set()
    for old, new in zip(before, after, strict=True):
        differs = (old != new).reshape(old.shape[0] * old.shape[1], -1).any(-1)
        changed |= set(differs.nonzero().flatten().tolist())
    return changed
