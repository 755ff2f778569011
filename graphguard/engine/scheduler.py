"""Continuous batching over a paged KV pool, with preemption by recompute.

Each step decodes one token for every running sequence and prefills the waiting sequences that
fit (FIFO, by free KV blocks, by the step's token budget and by ``max_num_seqs``). When a running
sequence needs a new block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the waiting queue with its
output kept, so a later prefill recomputes prompt + output so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from graphguard.engine.sequence import Sequence, SequenceStatus, num_blocks_for


class BlockPool(Protocol):
    """The part of PagedKVStorage the scheduler uses."""

    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def can_allocate(self, n: int) -> bool: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: list[int]) -> None: ...


@dataclass
class ScheduledBatch:
    """One step's work. ``seqs`` is the request order in which outputs are returned."""

    decodes: list[Sequence] = field(default_factory=list)  # one query token each
    prefills: list[Sequence] = field(default_factory=list)  # all of their tokens

    @property
    def seqs(self) -> list[Sequence]:
        # Decodes were admitted before this step's prefills, so this is admission order.
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(seq.num_tokens for seq in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Decides which sequences run in each step and owns their KV block tables."""

    def __init__(self, kv: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Reserve KV for one step: a decode slot per running sequence, then new prefills."""
        decodes, did_preempt = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(decodes)
        # After a preemption the pool is short; admitting now would only preempt again.
        prefills = [] if did_preempt else self._schedule_prefills(budget)
        return ScheduledBatch(decodes=decodes, prefills=prefills)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence and return its blocks to the pool."""
        seq.finish(reason)
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is; its blocks are free when this returns."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finish("abort")
                    self._release(seq)
                    return seq
        return None

    def abort_all(self) -> list[Sequence]:
        ids = [seq.request_id for seq in (*self.running, *self.waiting)]
        return [seq for seq in map(self.abort, ids) if seq is not None]

    def _schedule_decodes(self) -> tuple[list[Sequence], bool]:
        scheduled: list[Sequence] = []
        candidates = list(self.running)
        did_preempt = False
        while candidates:
            seq = candidates.pop(0)
            while not self._can_append_slot(seq):
                did_preempt = True
                # The most recently admitted one goes: the last candidate, else seq itself.
                victim = candidates.pop() if candidates else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._append_slot(seq)
                scheduled.append(seq)
        return scheduled, did_preempt

    def _schedule_prefills(self, budget: int) -> list[Sequence]:
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_blocks = num_blocks_for(seq.num_tokens, self.block_size)
            if seq.num_tokens > budget or not self.kv.can_allocate(num_blocks):
                break  # FIFO: nobody overtakes the head of the queue
            budget -= seq.num_tokens
            self.waiting.popleft()
            seq.block_table = self.kv.allocate(num_blocks)
            seq.num_cached_tokens = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _can_append_slot(self, seq: Sequence) -> bool:
        # The query token sits at position num_tokens - 1; its KV needs num_tokens slots.
        needs_block = num_blocks_for(seq.num_tokens, self.block_size) > len(seq.block_table)
        return not needs_block or self.kv.can_allocate(1)

    def _append_slot(self, seq: Sequence) -> None:
        if num_blocks_for(seq.num_tokens, self.block_size) > len(seq.block_table):
            seq.block_table.extend(self.kv.allocate(1))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.kv.free(seq.block_table)
            seq.block_table = []
