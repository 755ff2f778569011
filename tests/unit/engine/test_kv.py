"""PagedKVStorage: block accounting, the reserved dummy block, release."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.scheduling.kv import OutOfBlocksError, PagedKVStorage


def make_kv(num_blocks: int = 8, block_size: int = 4) -> PagedKVStorage:
    return PagedKVStorage(
        num_layers=2,
        num_kv_heads=3,
        head_dim=8,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=torch.float32,
        device="cpu",
    )


def test_dummy_block_is_reserved_from_the_start() -> None:
    kv = make_kv(num_blocks=8)
    assert kv.num_free_blocks == 7
    assert kv.num_used_blocks == 0


def test_allocating_every_block_never_hands_out_the_dummy_block() -> None:
    kv = make_kv(num_blocks=8)
    blocks = kv.allocate(7)
    assert PagedKVStorage.DUMMY_BLOCK not in blocks
    assert sorted(blocks) == list(range(1, 8))


def test_allocate_and_free_keep_the_counts() -> None:
    kv = make_kv(num_blocks=8)
    first, second = kv.allocate(3), kv.allocate(2)
    assert (kv.num_used_blocks, kv.num_free_blocks) == (5, 2)
    kv.free(first)
    assert (kv.num_used_blocks, kv.num_free_blocks) == (2, 5)
    assert not set(first) & set(second)


def test_allocate_beyond_free_raises_and_changes_nothing() -> None:
    kv = make_kv(num_blocks=4)
    kv.allocate(2)
    assert not kv.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        kv.allocate(2)
    assert kv.num_free_blocks == 1


def test_freed_blocks_can_be_allocated_again() -> None:
    kv = make_kv(num_blocks=3)
    blocks = kv.allocate(2)
    kv.free(blocks)
    assert sorted(kv.allocate(2)) == sorted(blocks)


def test_freeing_a_block_twice_raises() -> None:
    kv = make_kv()
    blocks = kv.allocate(2)
    kv.free(blocks)
    with pytest.raises(ValueError):
        kv.free(blocks[:1])


def test_freeing_the_dummy_block_raises() -> None:
    kv = make_kv()
    with pytest.raises(ValueError):
        kv.free([PagedKVStorage.DUMMY_BLOCK])


def test_cache_tensors_have_the_paged_layout() -> None:
    kv = make_kv(num_blocks=8, block_size=4)
    assert len(kv.k_cache) == len(kv.v_cache) == 2
    assert kv.k_cache[0].shape == (8, 4, 3, 8)
    assert kv.kv_bytes == 2 * 2 * 8 * 4 * 3 * 8 * 4  # K and V, 2 layers, float32


def test_release_drops_the_tensors_and_is_idempotent() -> None:
    kv = make_kv()
    kv.release()
    kv.release()
    assert kv.kv_bytes == 0
    assert kv.k_cache == [] and kv.v_cache == []


def test_a_shared_block_is_free_only_when_its_last_holder_frees_it() -> None:
    kv = make_kv(num_blocks=8)
    (block,) = kv.allocate(1)
    kv.share([block])
    kv.free([block])
    assert kv.num_holders(block) == 1 and kv.num_free_blocks == 6
    kv.free([block])
    assert kv.num_holders(block) == 0 and kv.num_free_blocks == 7
    with pytest.raises(ValueError):
        kv.free([block])


def test_only_a_block_in_use_can_be_shared() -> None:
    kv = make_kv(num_blocks=8)
    with pytest.raises(ValueError):
        kv.share([3])


def test_copy_block_copies_k_and_v_of_every_layer() -> None:
    kv = make_kv(num_blocks=8)
    src, dst = kv.allocate(2)
    for cache in (*kv.k_cache, *kv.v_cache):
        cache[src].normal_()
    kv.copy_block(src, dst)
    assert all(torch.equal(c[src], c[dst]) for c in (*kv.k_cache, *kv.v_cache))
