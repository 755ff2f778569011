"""PagedKVStorage: the one owner of KV blocks and the per-layer K/V tensors."""

from __future__ import annotations

import torch
from torch import Tensor


class OutOfBlocksError(RuntimeError):
    """Raised when more KV blocks are asked for than are free."""


class PagedKVStorage:
    """Fixed pool of KV blocks shared by all sequences, one K and one V tensor per layer.

    Block ``DUMMY_BLOCK`` is reserved: it is never handed out, and padded decode rows write
    their (ignored) K/V into it, so a padded row never touches a block a real row reads.
    A block may be held by several sequences at once (siblings sharing a prompt's full
    blocks): each holder counts one reference, and the block is free again only when every
    holder has freed it.
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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the K and V tensors of all layers (0 once released)."""
        return sum(t.numel() * t.element_size() for t in (*self.k_cache, *self.v_cache))

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` free block ids; raises OutOfBlocksError if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._refs.update((block, 1) for block in blocks)
        return blocks

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
