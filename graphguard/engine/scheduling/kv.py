"""PagedKVStorage: the one owner of KV blocks and the per-layer K/V tensors, and of the prefix
cache: full blocks keyed by the hash of their tokens and of every token before them."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

TOKEN_BYTES = array("q").itemsize  # a token id's bytes where prefixes are hashed


class OutOfBlocksError(RuntimeError):
    """Raised when more KV blocks are asked for than are free."""


class PagedKVStorage:
    """Fixed pool of KV blocks shared by all sequences, one K and one V tensor per layer.

    Block ``DUMMY_BLOCK`` is reserved: it is never handed out, and padded decode rows write
    their (ignored) K/V into it, so a padded row never touches a block a real row reads.
    A block may be held by several sequences at once (siblings sharing a prompt's full
    blocks, requests sharing a cached prefix): each holder counts one reference, and the block
    is free again only when every holder has freed it.

    Prefix cache: a full block whose KV is written may be registered under its prefix hash
    (`prefix_hashes`). A registered block that no one holds any more stays cached, least
    recently freed first in line to be reused for new KV (`allocate` takes free blocks first);
    `claim_prefix` hands the longest cached prefix of a new request to it.
    """

    DUMMY_BLOCK = 0

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled so that reading the dummy block (padded rows) never meets NaN garbage.
        self.k_cache: list[Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v_cache: list[Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # Low ids first: pop() from the end of a reversed list hands out 1, 2, 3, ...
        self._free: list[int] = list(range(num_blocks - 1, self.DUMMY_BLOCK, -1))
        self._refs: dict[int, int] = {}  # block in use -> number of holders (>= 1)
        self._cached: dict[bytes, int] = {}  # prefix hash -> block holding that prefix's KV
        self._hash_of: dict[int, bytes] = {}  # the inverse, for blocks registered
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, held by no one: LRU first
        # bumped by clear_prefix_cache: KV written by a request admitted before is never cached
        self.prefix_generation = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` may hand out: free ones, and cached ones no one holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or idle)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors of all layers (0 once released)."""
        return sum(t.numel() * t.element_size() for t in (*self.k_cache, *self.v_cache))

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` block ids, free ones first, then the least recently used idle cached
        ones (forgotten by the cache); raises OutOfBlocksError if fewer are available."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        blocks = [self._free.pop() if self._free else self._evict() for _ in range(n)]
        self._refs.update((block, 1) for block in blocks)
        return blocks

    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        del self._cached[self._hash_of.pop(block)]
        return block

    # -- the prefix cache -----------------------------------------------------------------
    def register(self, block: int, prefix_hash: bytes) -> None:
        """`block` (in use, full, its KV written) holds the prefix `prefix_hash` names."""
        if prefix_hash not in self._cached and block not in self._hash_of:
            self._cached[prefix_hash] = block
            self._hash_of[block] = prefix_hash

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (nothing claimed)."""
        blocks = []
        for prefix_hash in hashes:
            block = self._cached.get(prefix_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_idle(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are idle: claiming them takes them from what `allocate` has."""
        return sum(block in self._idle for block in blocks)

    def claim_prefix(self, blocks: Sequence[int]) -> list[int]:
        """One more holder for each cached block of a prefix (idle ones come back in use)."""
        for block in blocks:
            if block in self._idle:
                del self._idle[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
        return list(blocks)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (new weights: the cached KV is stale)."""
        self.prefix_generation += 1
        self._free.extend(reversed(self._idle))
        self._idle.clear()
        self._cached.clear()
        self._hash_of.clear()

    def share(self, blocks: list[int]) -> list[int]:
        """One more holder for each of ``blocks`` (in use already); returns them."""
        self._check_in_use(blocks)
        for block in blocks:
            self._refs[block] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a block with none left returns to the pool.
        Freeing a block that is not in use (or one block twice in a call) raises ValueError."""
        self._check_in_use(blocks)
        for block in blocks:
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                if block in self._hash_of:
                    self._idle[block] = None  # cached: reused for new KV last
                else:
                    self._free.append(block)

    def num_holders(self, block: int) -> int:
        """Sequences holding ``block`` (0: free)."""
        return self._refs.get(block, 0)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy the K/V of every layer from block ``src`` to block ``dst`` (both in use)."""
        self._check_in_use([src, dst])
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst].copy_(cache[src])

    def _check_in_use(self, blocks: list[int]) -> None:
        unknown = [b for b in blocks if b not in self._refs]
        if unknown or len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks not in use (or repeated): {sorted(set(unknown) or blocks)}")

    def release(self) -> None:
        """Drop the K/V tensors (shutdown). Idempotent; accounting is left as it was."""
        self.k_cache = []
        self.v_cache = []

    @property
    def is_released(self) -> bool:
        return not self.k_cache


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """The prefix hash of each of the first `num_blocks` full blocks of `token_ids`: a digest of
    the block's tokens and of the hash before it, so equal hashes mean equal whole prefixes.
    `known`: the hashes of the first blocks, computed before; only the rest are computed."""
    return chain_hashes(token_bytes(token_ids, block_size, num_blocks), block_size, known)


def token_bytes(token_ids: Sequence[int], block_size: int, num_blocks: int) -> bytes:
    """The first `num_blocks` full blocks of `token_ids` as int64 bytes: what is hashed."""
    return array("q", token_ids[: num_blocks * block_size]).tobytes()


def chain_hashes(
    data: bytes, block_size: int, known: Sequence[bytes] = (), salt: bytes = b""
) -> list[bytes]:
    """`prefix_hashes` of the blocks whose int64 bytes are `data` (`token_bytes`); `salt`
    begins the chain (a request's cache salt: equal blocks of other salts hash apart)."""
    stride = block_size * TOKEN_BYTES
    num_blocks = len(data) // stride
    hashes = list(known[:num_blocks])
    previous = hashes[-1] if hashes else salt
    view, digest = memoryview(data), hashlib.blake2b
    for start in range(len(hashes) * stride, num_blocks * stride, stride):
        previous = digest(previous + view[start : start + stride], digest_size=16).digest()
        hashes.append(previous)
    return hashes
