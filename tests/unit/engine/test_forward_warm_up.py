"""The engine's kernel warm-up at start: decodes and a prefill that touch only the dummy block."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.models import build_model
from graphguard.engine.models.forward import EagerForward
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.shapes import ROW_BUCKETS
from graphguard.kernels.reference import TorchKernels
from tests.kv_checks import changed_slots
from tests.tiny import tiny_config


@pytest.mark.parametrize("row_area", [0, 512 * 2048], ids=["grouped", "rows"])
def test_warm_up_writes_only_the_dummy_block(row_area, monkeypatch):
    # with prefills run as rows, one of each token bucket runs as well
    monkeypatch.setattr(TorchKernels, "row_prefill_area", row_area)
    config = tiny_config(max_position_embeddings=1024)
    model = build_model(config, dtype=torch.float32, device="cpu", seed=0)
    kv = PagedKVStorage(
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_blocks=8, block_size=16, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    for cache in (*kv.k_cache, *kv.v_cache):
        cache.normal_()
    before = [c.clone() for c in (*kv.k_cache, *kv.v_cache)]
    forward = EagerForward(model, kv)
    rows_called: list[int] = []
    rows = forward.rows

    def counted(*args):
        rows_called.append(len(args[0]))
        return rows(*args)

    monkeypatch.setattr(forward, "rows", counted)
    forward.warm_up()
    # the decodes call rows too: 1, 2 and 16 rows at two widths
    decodes = [1, 1, 2, 2, 16, 16]
    assert rows_called == decodes + (list(ROW_BUCKETS) if row_area else [])
    changed = changed_slots(before, [*kv.k_cache, *kv.v_cache])
    dummy = range(PagedKVStorage.DUMMY_BLOCK * 16, (PagedKVStorage.DUMMY_BLOCK + 1) * 16)
    assert changed and changed <= set(dummy)
