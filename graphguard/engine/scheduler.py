"""Continuous batching over a paged KV pool, with chunked prefill and preemption by recompute.

Each step decodes one token for every running sequence whose prefill is done, continues the
prefills in progress, then admits waiting sequences (FIFO, by free KV blocks and by
``max_num_seqs``), all within the step's token budget. A prompt longer than what is left of the
budget is prefilled in chunks over several steps (its KV blocks are reserved at admission), so
one long prompt never makes a step longer than the budget. When a running sequence needs a new
block and none is free, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the front of the waiting queue with its output kept, so a later
prefill recomputes prompt + output so far.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from graphguard.engine.batch import PrefillChunk, ScheduledBatch
from graphguard.engine.sequence import Sequence, SequenceStatus, num_blocks_for


class BlockPool(Protocol):
    """The part of PagedKVStorage the scheduler uses."""

    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    def can_allocate(self, n: int) -> bool: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: list[int]) -> None: ...


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
        """Reserve KV for one step: a decode slot per running sequence done with its prefill,
        the next chunk of each prefill in progress, then new prefills."""
        decodes, did_preempt = self._schedule_decodes()
        batch = ScheduledBatch(decodes=decodes)
        budget = self.max_num_batched_tokens - len(decodes)
        for seq in self.running:
            if seq in decodes or budget <= 0:
                continue
            chunk = min(seq.num_tokens - seq.num_cached_tokens, budget)
            batch.prefills.append(PrefillChunk.of(seq, chunk))
            budget -= chunk
        # After a preemption the pool is short; admitting now would only preempt again.
        if not did_preempt:
            batch.prefills += [PrefillChunk.of(seq, chunk) for seq, chunk in self._admit(budget)]
        return batch

    def advance(self, batch: ScheduledBatch) -> None:
        """After the step ran: prefills that did not finish have their chunk's KV written."""
        for chunk in batch.prefills:
            if not chunk.completes:
                chunk.seq.num_cached_tokens += chunk.num_tokens

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
        did_preempt = False
        for seq in [s for s in self.running if _decodes_next(s)]:
            if seq not in self.running:
                continue  # preempted below to make room for an older sequence
            while not self._can_append_slot(seq):
                did_preempt = True
                # The most recently admitted one goes (a prefill in progress too), else seq.
                victim = next(s for s in reversed(self.running) if s not in scheduled)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self._append_slot(seq)
                scheduled.append(seq)
        return scheduled, did_preempt

    def _admit(self, budget: int) -> list[tuple[Sequence, int]]:
        """Waiting sequences that start their prefill this step, in order, with the tokens
        each runs, while `budget` tokens are left: the last one may get only a first chunk."""
        admitted: list[tuple[Sequence, int]] = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            num_blocks = num_blocks_for(seq.num_tokens, self.block_size)
            if not self.kv.can_allocate(num_blocks):
                break  # FIFO: nobody overtakes the head of the queue
            chunk = min(seq.num_tokens, budget)
            budget -= chunk
            self.waiting.popleft()
            seq.block_table = self.kv.allocate(num_blocks)
            seq.num_cached_tokens = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append((seq, chunk))
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


def _decodes_next(seq: Sequence) -> bool:
    """Every token but the last is cached: the step computes that one and samples the next.
    A prefill with one prompt token left is the same computation, unless that token is an
    image placeholder (decode does not splice images): it stays a one-token prefill."""
    last = seq.num_tokens - 1
    return seq.num_cached_tokens == last and last not in seq.image_positions
