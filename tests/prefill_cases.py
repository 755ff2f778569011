"""Packed prefill steps over a paged cache, shared by the prefill attention kernel's tests: random
queries and cache contents, shuffled block tables, sequences that continue over a cached prefix,
and the plain PyTorch reference (`paged_prefill_attention`) computed in float32."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from graphguard.engine.models.attention import AttentionMetadata, paged_prefill_attention
from graphguard.kernels import HeadShape


class PackedPrefill(NamedTuple):
    """One prefill step: packed queries, the cache (the new tokens' K/V written), metadata."""

    q: Tensor  # [T, Hq, D]
    kv_cache: tuple[Tensor, Tensor]  # [num_blocks, block_size, Hkv, D] each
    meta: AttentionMetadata

    def new_kv(self) -> tuple[Tensor, Tensor]:
        """The new tokens' K/V ``[T, Hkv, D]``, read back from their cache slots."""
        k_cache, v_cache = self.kv_cache
        shape = (-1, *k_cache.shape[2:])
        slots = self.meta.slot_mapping
        return k_cache.view(shape)[slots], v_cache.view(shape)[slots]


def packed_prefill(
    heads: HeadShape,
    query_lens: list[int],
    cached: list[int],
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int = 16,
    seed: int = 0,
) -> PackedPrefill:
    """Sequences of `query_lens` new tokens after `cached` tokens already in the cache, each in
    blocks of a shuffled table (block 0 unused), every slot of the cache random."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 1
    shape = (num_blocks, block_size, heads.num_kv_heads, heads.head_dim)
    k_cache, v_cache = torch.randn(2, *shape, generator=gen).to(device=device, dtype=dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(len(seq_lens), width)
    slots = []
    for table, first, end in zip(tables.tolist(), cached, seq_lens, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(first, end)]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads.num_heads, heads.head_dim, generator=gen)
    starts = torch.tensor([0, *query_lens]).cumsum(0)

    def on_device(values: Tensor | list[int], dtype: torch.dtype = torch.int32) -> Tensor:
        return torch.as_tensor(values).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        packed=True,
        slot_mapping=on_device(slots, torch.int64),
        block_tables=on_device(tables),
        seq_lens=on_device(seq_lens),
        query_start_loc=on_device(starts),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=list(query_lens),
    )
    return PackedPrefill(q.to(device=device, dtype=dtype), (k_cache, v_cache), meta)


def reference_attention(batch: PackedPrefill, scale: float) -> Tensor:
    """The plain PyTorch prefill attention of `batch`, in float32."""
    k, v = batch.new_kv()
    k_cache, v_cache = batch.kv_cache
    return paged_prefill_attention(
        batch.q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), batch.meta, scale
    )
