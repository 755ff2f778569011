"""Prefix caching for the scheduler: a new request reuses the cached KV blocks of its longest
cached prefix and prefills only the rest.

Full blocks are keyed by the hash of their tokens and of every token before them
(graphguard.engine.scheduling.kv `prefix_hashes`), registered once their KV is written: as a
prefill chunk completes them, and when a sequence lets its blocks go (finished, aborted or
preempted: a preempted sequence finds its own prompt cached when it is admitted again). A
block no one holds stays cached until the pool needs it, least recently freed first.

A prefix being computed is not computed again: a waiting request whose next blocks a running
prefill is writing (two requests over one document, arrived together) waits for them and
reuses them once written, when they are at least MIN_WAIT_TOKENS; a shorter run is computed
again, as waiting costs the request at least one step.

A request's `cache_salt` begins its hash chain: requests share cached blocks only within one
salt (vLLM's), so a tenant cannot learn from a request's speed what another one sent. Not
cached: a sequence with images (its KV depends on more than its tokens), and no reuse for
one that asks for prompt logprobs (every prompt token must be scored). New weights clear the
cache (`LLMEngine.reload_weights`). At least the last prompt token is always computed: its
logits start the answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from graphguard.engine.scheduling.kv import TOKEN_BYTES, PagedKVStorage, chain_hashes, token_bytes
from graphguard.engine.scheduling.sequence import Sequence

# The shortest run of blocks in flight that a waiting request waits for rather than computes
MIN_WAIT_TOKENS = 256
# Prompts whose hashes a new prompt may start from (RecentPrompts), by their first block
RECENT_PROMPTS = 32


class RecentPrompts:
    """The hashed blocks of recent prompts, by their first block: a prompt that begins as one
    of them (a shared document, a conversation's history) hashes only the blocks after their
    common prefix. Equal bytes have equal hashes, so nothing is taken on trust: the common
    prefix is found by comparing the tokens.

    NOTE: a 4k-token prompt's 256 digests took 0.2-0.3 ms of host time; a wave of 16 requests
    over one document paid 16 times that before its step could run (docs/serving.md, "Prefix
    caching")."""

    def __init__(self, capacity: int = RECENT_PROMPTS) -> None:
        self.capacity = capacity
        self._by_first: OrderedDict[bytes, tuple[bytes, list[bytes]]] = OrderedDict()

    def hashes(
        self, data: bytes, block_size: int, known: list[bytes], salt: bytes = b""
    ) -> list[bytes]:
        """The prefix hashes of the blocks whose int64 bytes are `data` (`token_bytes`), the
        first `known` given, under `salt`; remembers them for the prompts after it."""
        stride = block_size * TOKEN_BYTES
        if len(data) < stride:
            return list(known)
        first = salt + data[:stride]  # NOTE: a prompt of another salt never starts as this one
        recent = self._by_first.get(first)
        common = 0
        if recent is not None:
            common = _common_blocks(data, recent[0], stride)
            if common > len(known):
                known = recent[1][:common]
        hashes = chain_hashes(data, block_size, known, salt)
        # NOTE: a prompt that is a prefix of the remembered one adds nothing to it.
        if recent is None or common < len(hashes) or len(hashes) >= len(recent[1]):
            self._by_first[first] = (data, hashes)
        self._by_first.move_to_end(first)
        if len(self._by_first) > self.capacity:
            self._by_first.popitem(last=False)
        return hashes


def _salt(seq: Sequence) -> bytes:
    """Where a request's prefix hashes begin: its cache salt's digest, so that requests of
    other salts share no cached block with it (vLLM's `cache_salt`)."""
    salt = seq.params.cache_salt
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest()


def _common_blocks(a: bytes, b: bytes, stride: int) -> int:
    """How many leading blocks of `stride` bytes `a` and `b` have equal."""
    low, high = 0, min(len(a), len(b)) // stride
    if a[: high * stride] == b[: high * stride]:
        return high
    while low < high - 1:  # a[:low] equals b[:low]; a[:high] does not equal b[:high]
        middle = (low + high) // 2
        if a[: middle * stride] == b[: middle * stride]:
            low = middle
        else:
            high = middle
    return low


class PrefixCache:
    """The scheduler's side of the pool's prefix cache (see module docstring)."""

    def __init__(self, kv: PagedKVStorage) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.num_lookup_tokens = 0  # prompt tokens of the sequences admitted
        self.num_hit_tokens = 0  # of those, tokens whose KV came from the cache
        self.recent = RecentPrompts()

    def reusable(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` may start from (nothing claimed yet)."""
        if not self._may_reuse(seq):
            return []
        limit = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        return self.kv.cached_prefix(self._hashes(seq, limit))

    def computing(self, seqs: Iterable[Sequence]) -> set[bytes]:
        """The prefix hashes of the full blocks that the prefills among `seqs` have yet to
        write and will cache (a decoding sequence writes none of its prompt's)."""
        hashes: set[bytes] = set()
        for seq in seqs:
            prefilling = seq.num_cached_tokens < seq.num_tokens - 1
            if not prefilling or not self._caches(seq):
                continue
            num_full = seq.num_tokens // self.block_size
            hashes.update(self._hashes(seq, num_full)[seq.num_cached_tokens // self.block_size :])
        return hashes

    def coming(self, seq: Sequence, reused: list[int], computing: set[bytes]) -> int:
        """How many of the blocks after `seq`'s cached prefix (`reused`), in a row, a running
        prefill is writing (`computing`): blocks `seq` may reuse once they are written."""
        if not computing or not self._may_reuse(seq):
            return 0
        limit = (seq.num_tokens - 1) // self.block_size
        num = 0
        for prefix_hash in self._hashes(seq, limit)[len(reused) :]:
            if prefix_hash not in computing:
                break
            num += 1
        return num

    def waits(self, num_coming: int) -> bool:
        """Whether a request waits for `num_coming` blocks being written rather than compute
        them: at least MIN_WAIT_TOKENS of them."""
        return num_coming * self.block_size >= MIN_WAIT_TOKENS

    def num_taken(self, blocks: list[int]) -> int:
        """Blocks claiming `blocks` takes from what the pool can allocate (the idle ones)."""
        return self.kv.num_idle(blocks)

    def claim(self, seq: Sequence, blocks: list[int]) -> list[int]:
        """`seq` holds the cached `blocks` from now on; what it writes is cached in this
        generation of the cache only."""
        seq.cache_generation = self.kv.prefix_generation
        self.num_lookup_tokens += seq.num_tokens
        self.num_hit_tokens += len(blocks) * self.block_size
        return self.kv.claim_prefix(blocks)

    def register(self, seq: Sequence, num_written: int) -> None:
        """The full blocks among `seq`'s first `num_written` tokens (their KV written) are
        cached under their prefix hashes (unless the cache was cleared since `seq` was
        admitted: its KV may be the old weights')."""
        if not self._caches(seq):
            return
        num_full = min(num_written // self.block_size, len(seq.block_table))
        for block, prefix_hash in zip(seq.block_table, self._hashes(seq, num_full), strict=False):
            self.kv.register(block, prefix_hash)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0

    def stats(self) -> dict[str, float | int]:
        return {
            "hit_rate": round(self.hit_rate, 4),
            "hit_tokens": self.num_hit_tokens,
            "cached_blocks": self.kv.num_cached_blocks,
        }

    def _caches(self, seq: Sequence) -> bool:
        """Whether the blocks `seq` writes are cached."""
        return not seq.image_positions and seq.cache_generation == self.kv.prefix_generation

    @staticmethod
    def _may_reuse(seq: Sequence) -> bool:
        return not seq.image_positions and seq.params.prompt_logprobs is None

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix hashes of `seq`'s first `num_blocks` full blocks (remembered on it)."""
        known = seq.prefix_hashes
        if len(known) < num_blocks:
            # every full block at once: the next call asks for one more (computing, register)
            num_full = max(num_blocks, seq.num_tokens // self.block_size)
            length = num_full * self.block_size
            if seq.prompt_bytes is not None and length <= seq.num_prompt_tokens:
                data = seq.prompt_bytes[: length * TOKEN_BYTES]
            else:
                data = token_bytes(seq.token_ids, self.block_size, num_full)
            known[:] = self.recent.hashes(data, self.block_size, known, _salt(seq))
        return known[:num_blocks]
