"""The engine's kernel warm-up at start: decodes and a prefill that touch only the dummy block."""

from __future__ import annotations

import torch

from graphguard.engine.forward import EagerForward
from graphguard.engine.kv import PagedKVStorage
from graphguard.engine.models import build_model
from tests.kv_checks import changed_slots
from tests.tiny import tiny_config


def test_warm_up_writes_only_the_dummy_block():
    config = tiny_config(max_position_embeddings=1024)
    model = build_model(config, dtype=torch.float32, device="cpu", seed=0)
    kv = PagedKVStorage(
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_blocks=8, block_size=16, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    for cache in (*kv.k_cache, *kv.v_cache):
        cache.normal_()
    before = [c.clone() for c in (*kv.k_cache, *kv.v_cache)]
    EagerForward(model, kv).warm_up()
    changed = changed_slots(before, [*kv.k_cache, *kv.v_cache])
    dummy = range(PagedKVStorage.DUMMY_BLOCK * 16, (PagedKVStorage.DUMMY_BLOCK + 1) * 16)
    assert changed and changed <= set(dummy)
