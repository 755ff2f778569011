"""Continuous batching over a paged KV pool, with chunked prefill and preemption by recompute.

Each step decodes one token for every running sequence whose prefill is done, continues the
prefills in progress, then admits waiting sequences (FIFO, by free KV blocks and by
``max_num_seqs``), all within the step's token budget. A prompt longer than what is left of the
budget is prefilled in chunks over several steps (its KV blocks are reserved at admission), so
one long prompt never makes a step longer than the budget. When a running sequence needs a new
block and none is free, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the front of the waiting queue with its output kept, so a later
prefill recomputes prompt + output so far. With prefix caching, a waiting sequence whose next
blocks a running prefill is writing stays queued in its place until they are written, then
reuses them (PrefixCache.waits); meanwhile it holds the slots and blocks it will take, and the
sequences behind it are admitted, in their order, into what is left.

Choices of one request (n > 1) share one prefill: the siblings wait as ``forks`` of the first
choice, are admitted with it (room for all of them, and a reserved block each for a copy of
the prompt's partly filled last block), and start when its prefill completes: each holds the
prompt's full blocks by reference (the pool counts holders) and its own copy of the last one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from graphguard.engine.scheduling.batch import PrefillChunk, ScheduledBatch
from graphguard.engine.scheduling.prefix_cache import PrefixCache
from graphguard.engine.scheduling.sequence import Sequence, SequenceStatus, num_blocks_for
from graphguard.engine.tokens.structured import InvalidParamError

# Sequences waiting for blocks being written that one admission passes over: each costs a
# look-up of its prefix, and the ones further back can wait for the next step.
MAX_WAITING_PASSED = 16


class BlockPool(Protocol):
    """The part of PagedKVStorage the scheduler uses."""

    block_size: int

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    def can_allocate(self, n: int) -> bool: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: list[int]) -> None: ...

    def share(self, blocks: list[int]) -> list[int]: ...

    def copy_block(self, src: int, dst: int) -> None: ...


class Scheduler:
    """Decides which sequences run in each step and owns their KV block tables."""

    def __init__(
        self,
        kv: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.kv = kv
        self.prefix_cache = prefix_cache  # None: every prompt is prefilled whole
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.num_prefilled_tokens = 0  # prompt (and recomputed) tokens run through prefill

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_fork(self, parent: Sequence, fork: Sequence) -> None:
        """Queue `fork` (same prompt) to start from `parent`'s prompt KV once `parent`'s
        prefill completes, instead of prefilling the prompt again. `parent` must be waiting
        and not yet admitted; admission then takes room for both."""
        if parent not in self.waiting or parent.num_output_tokens:
            raise ValueError(f"request {parent.request_id!r} has started; it cannot be forked")
        self._check_group_fits(parent, parent.group_size + 1)
        fork.status = SequenceStatus.WAITING
        parent.forks.append(fork)

    def _check_group_fits(self, parent: Sequence, group_size: int) -> None:
        if group_size > self.max_num_seqs:
            raise InvalidParamError(
                "n",
                f"n={group_size} choices cannot run together: max_num_seqs is {self.max_num_seqs}",
            )
        num_blocks = num_blocks_for(parent.num_tokens, self.block_size)
        num_blocks += (group_size - 1) if parent.num_tokens % self.block_size else 0
        num_usable = self.kv.num_free_blocks + self.kv.num_used_blocks
        if num_blocks > num_usable:
            raise InvalidParamError(
                "n",
                f"n={group_size} choices of this prompt need {num_blocks} KV blocks to start "
                f"together but the pool has {num_usable}",
            )

    @property
    def num_running_slots(self) -> int:
        """Running sequences, counting the forks that admitted prefills will start."""
        return sum(seq.group_size for seq in self.running)

    def has_pending_prefills(self) -> bool:
        """Whether a request waits for its first token: queued, or prefilling in chunks."""
        return bool(self.waiting) or not all(_decodes_next(seq) for seq in self.running)

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

    def advance(self, batch: ScheduledBatch) -> list[tuple[int, Sequence]]:
        """After the step ran: prefills that did not finish have their chunk's KV written, and
        the forks of sequences whose prompt is now cached start. Returns (row of the parent in
        ``batch.seqs``, fork) for each fork started: its first token is sampled from its
        parent's logits row, as the parent's is."""
        self.num_prefilled_tokens += sum(batch.chunks)
        for chunk in batch.prefills:
            if not chunk.completes:
                chunk.seq.num_cached_tokens += chunk.num_tokens
            if self.prefix_cache is not None:
                written = chunk.seq.num_tokens if chunk.completes else chunk.seq.num_cached_tokens
                self.prefix_cache.register(chunk.seq, written)
        started: list[tuple[int, Sequence]] = []
        for row, (seq, completes) in enumerate(zip(batch.seqs, batch.completes, strict=True)):
            if completes and seq.forks:
                started += [(row, fork) for fork in self._start_forks(seq)]
        return started

    def may_step_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether `seqs` are every running sequence, each decoding, with nothing waiting: the
        next step would be exactly these rows (graphguard/engine/step/overlap.py)."""
        return (
            not self.waiting
            and len(seqs) == len(self.running)
            and all(seq.status is SequenceStatus.RUNNING and _decodes_next(seq) for seq in seqs)
        )

    def reserve_ahead(self, seqs: list[Sequence]) -> bool:
        """KV for one token more than the step just scheduled, for each of `seqs` (a step
        launched before the last one's tokens are read); False, reserving nothing, when the
        pool is short."""
        size = self.block_size
        short = [s for s in seqs if num_blocks_for(s.num_tokens + 1, size) > len(s.block_table)]
        if not self.kv.can_allocate(len(short)):
            return False
        for seq in short:
            seq.block_table.extend(self.kv.allocate(1))
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence and return its blocks to the pool."""
        seq.finish(reason)
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is; its blocks are free when this returns. A sequence
        whose forks have not started yet hands them to the first of them, which takes its
        place in the queue and prefills the prompt itself."""
        for seq in self._unfinished():
            if seq.request_id == request_id:
                self._detach(seq)
                seq.finish("abort")
                return seq
        return None

    def abort_all(self) -> list[Sequence]:
        ids = [seq.request_id for seq in self._unfinished()]
        return [seq for seq in map(self.abort, ids) if seq is not None]

    def _unfinished(self) -> Iterator[Sequence]:
        for seq in (*self.running, *self.waiting):
            yield seq
            yield from seq.forks

    def _detach(self, seq: Sequence) -> None:
        """Take `seq` out of the queues, freeing its blocks and its forks' reservations."""
        self._release(seq)
        heir = _heir(seq)
        if seq in self.running:
            self.running.remove(seq)
            if heir is not None:  # it was admitted: its heir goes first
                self.waiting.appendleft(heir)
        elif seq in self.waiting:
            index = self.waiting.index(seq)
            del self.waiting[index]
            if heir is not None:
                self.waiting.insert(index, heir)
        else:  # a fork still waiting on its parent
            parent = next(p for p in (*self.running, *self.waiting) if seq in p.forks)
            parent.forks.remove(seq)

    def _start_forks(self, parent: Sequence) -> list[Sequence]:
        """Each fork holds the parent's full prompt blocks by reference and its reserved
        block with a copy of the partly filled last one (written by the step just run)."""
        forks, parent.forks = parent.forks, []
        num_prompt = parent.num_tokens  # the parent's first token is not appended yet
        num_full = num_prompt // self.block_size
        for fork in forks:
            reserved = fork.block_table
            fork.block_table = self.kv.share(parent.block_table[:num_full]) + reserved
            if reserved:
                self.kv.copy_block(parent.block_table[num_full], reserved[0])
            fork.num_cached_tokens = num_prompt
            fork.cache_generation = parent.cache_generation
            if parent.prompt_logprobs is not None:
                fork.prompt_logprobs = list(parent.prompt_logprobs)
            fork.status = SequenceStatus.RUNNING
            self.running.append(fork)
        return forks

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
        each runs, while `budget` tokens are left: the last one may get only a first chunk.
        One whose next blocks a running prefill is writing stays queued in its place, to
        reuse them later (PrefixCache.waits), holding the slots and blocks it will take: the
        sequences behind it are admitted only into what is left, so none overtakes it for
        good. At most MAX_WAITING_PASSED such sequences are passed a step."""
        admitted: list[tuple[Sequence, int]] = []
        cache = self.prefix_cache
        computing = cache.computing(self.running) if cache and self.waiting else set()
        index, held = 0, _Held()
        while index < len(self.waiting) and budget > 0 and held.seqs < MAX_WAITING_PASSED:
            seq = self.waiting[index]
            reused = cache.reusable(seq) if cache is not None else []
            coming = cache.coming(seq, reused, computing) if cache is not None else 0
            if cache is not None and cache.waits(coming):
                held.add(seq.group_size, self._blocks_needed(seq, reused) - coming)
                index += 1
                continue
            if not self._fits(seq, reused, held):
                break  # FIFO: nobody overtakes the first that does not fit
            del self.waiting[index]
            chunk = self._start(seq, reused, budget)
            budget -= chunk
            admitted.append((seq, chunk))
            if cache is not None:
                computing |= cache.computing([seq])
        return admitted

    def _fits(self, seq: Sequence, reused: list[int], held: _Held) -> bool:
        """Whether `seq`, starting from the cached blocks `reused`, fits the running slots and
        the pool beside what the sequences waiting in front of it hold."""
        if self.num_running_slots + held.slots + seq.group_size > self.max_num_seqs:
            return False
        return self.kv.can_allocate(self._blocks_needed(seq, reused) + held.blocks)

    def _blocks_needed(self, seq: Sequence, reused: list[int]) -> int:
        """Blocks admitting `seq` takes from the pool: its own beyond the cached `reused`, a
        copy of the prompt's last block per fork, and the idle cached blocks it claims."""
        num_blocks, num_copies = self._prompt_blocks(seq)
        taken = self.prefix_cache.num_taken(reused) if self.prefix_cache is not None else 0
        return num_blocks - len(reused) + num_copies + taken

    def _prompt_blocks(self, seq: Sequence) -> tuple[int, int]:
        """The blocks `seq`'s tokens fill, and the copies of the prompt's last block its forks
        need (none when that block is full)."""
        num_copies = len(seq.forks) if seq.num_tokens % self.block_size else 0
        return num_blocks_for(seq.num_tokens, self.block_size), num_copies

    def _start(self, seq: Sequence, reused: list[int], budget: int) -> int:
        """Give `seq` its blocks (the cached `reused` ones first) and a running slot; returns
        the tokens of its first chunk."""
        num_blocks, num_copies = self._prompt_blocks(seq)
        if self.prefix_cache is not None:
            reused = self.prefix_cache.claim(seq, reused)  # NOTE: before allocating (evicts)
        seq.block_table = reused + self.kv.allocate(num_blocks - len(reused))
        for fork in seq.forks:  # a block each for its copy of the prompt's last block
            fork.block_table = self.kv.allocate(1 if num_copies else 0)
        seq.num_cached_tokens = len(reused) * self.block_size
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return min(seq.num_tokens - seq.num_cached_tokens, budget)

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
        """Free `seq`'s blocks and the blocks reserved for its forks (which stay its forks); the
        full ones whose KV is written stay in the prefix cache."""
        if self.prefix_cache is not None and seq.block_table:
            self.prefix_cache.register(seq, seq.num_cached_tokens)
        for one in (seq, *seq.forks):
            if one.block_table:
                self.kv.free(one.block_table)
                one.block_table = []


@dataclass
class _Held:
    """What the sequences passed over in one admission (waiting for blocks being written)
    will take: running slots and pool blocks."""

    seqs: int = 0
    slots: int = 0
    blocks: int = 0

    def add(self, slots: int, blocks: int) -> None:
        self.seqs, self.slots, self.blocks = self.seqs + 1, self.slots + slots, self.blocks + blocks


def _heir(seq: Sequence) -> Sequence | None:
    """The first of `seq`'s forks, now holding the others: it prefills the prompt in `seq`'s
    stead when `seq` goes before its prefill completed. None without forks."""
    if not seq.forks:
        return None
    heir, *others = seq.forks
    seq.forks = []
    heir.forks = others
    return heir


def _decodes_next(seq: Sequence) -> bool:
    """Every token but the last is cached: the step computes that one and samples the next.
    A prefill with one prompt token left is the same computation, unless that token is an
    image placeholder (decode does not splice images): it stays a one-token prefill."""
    last = seq.num_tokens - 1
    return seq.num_cached_tokens == last and last not in seq.image_positions
