"""The engine's segmented prefill on a tiny random decoder: same hidden states as forward()."""

from __future__ import annotations

import pytest
import torch

from graphguard.core.admission import AdmissionConfig
from graphguard.core.options import CaptureConfig
from graphguard.core.sim import SimBackend
from graphguard.engine.models import build_model
from graphguard.engine.models.attention import AttentionMetadata
from graphguard.engine.models.forward import (
    ImageSplice,
    PrefillContext,
    eager_prefill,
    prefill_inputs,
    prefill_stages,
)
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.segmented import SegmentedRunner, run_eager, split_segments
from tests.tiny import tiny_config

BLOCK = 4


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


@pytest.fixture(params=["llama", "qwen3"])
def model(request):
    return build_model(tiny_config(request.param), dtype=torch.float32, device="cpu", seed=0)


def kv_for(model) -> PagedKVStorage:
    c = model.config
    return PagedKVStorage(
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_blocks=32,
        block_size=BLOCK,
        dtype=torch.float32,
        device="cpu",
    )


def packed_prefill(lengths: list[int], seed: int = 0):
    """ids, positions and metadata of a packed prefill of fresh sequences (blocks from 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    tables, slots, next_block = [], [], 1
    for n in lengths:
        table = list(range(next_block, next_block + -(-n // BLOCK)))
        next_block += len(table)
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    width = max(len(t) for t in tables)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    meta = AttentionMetadata(
        packed=True,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=lengths,
        query_lens_cpu=lengths,
    )
    return ids, positions, meta


def splice_for(model, rows: list[int], seed: int = 0) -> ImageSplice:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(len(rows), model.config.hidden_size, generator=g)
    return ImageSplice(torch.tensor(rows), embeds)


def test_a_model_of_l_layers_has_l_plus_one_segments(model):
    pieces = split_segments(prefill_stages(model, kv_for(model)))
    assert sum(1 for p in pieces if not getattr(p, "eager", False)) == 3
    assert [p.name for p in pieces if getattr(p, "eager", False)] == ["attn0", "attn1"]


def test_each_layers_kv_write_is_in_its_capturable_segment_not_the_eager_stage(model):
    ids, positions, meta = packed_prefill([5, 9])
    kv = kv_for(model)
    first, attention = split_segments(prefill_stages(model, kv))[:2]
    with torch.no_grad():
        carry = first(*prefill_inputs(model, ids, positions, None, meta))
    _, _, k, v, *_ = carry  # residual, q, k, v, cos, sin, slots
    slots = meta.slot_mapping
    assert torch.equal(kv.k_cache[0].flatten(0, 1)[slots], k)
    assert torch.equal(kv.v_cache[0].flatten(0, 1)[slots], v)
    assert not kv.k_cache[1].any()  # the next layer's is in the next segment
    assert getattr(attention, "eager", False)


def test_the_eager_pipeline_equals_forward_bitwise(model):
    ids, positions, meta = packed_prefill([5, 9])
    kv = kv_for(model)
    with torch.no_grad():
        want = model(ids, positions, meta, kv)
        pieces = split_segments(prefill_stages(model, kv))
        carry = prefill_inputs(model, ids, positions, None, meta)
        got = run_eager(pieces, carry, PrefillContext(meta, kv))
    assert torch.equal(got[0], want)


def test_spliced_rows_change_only_when_images_differ(model):
    ids, positions, meta = packed_prefill([7])
    kv = kv_for(model)
    with torch.no_grad():
        text = eager_prefill(model, kv, ids, positions, meta, None)
        one = eager_prefill(model, kv, ids, positions, meta, splice_for(model, [2, 3], seed=1))
        two = eager_prefill(model, kv, ids, positions, meta, splice_for(model, [2, 3], seed=2))
    assert torch.equal(one[:2], text[:2])  # causal: rows before the image are untouched
    assert not torch.equal(one[2:], text[2:]) and not torch.equal(one[2:], two[2:])


def test_segmented_graphs_equal_eager_with_changed_images_and_text(model):
    kv = kv_for(model)
    runner = SegmentedRunner(
        prefill_stages(model, kv),
        backend=SimBackend(),
        admission=AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0),
        capture=CaptureConfig(retain=(model, kv)),
    )
    for seed in range(3):  # the same shape: new text and a new image each time
        ids, positions, meta = packed_prefill([6, 4], seed=seed)
        splice = splice_for(model, [1, 2, 7], seed=seed)
        with torch.no_grad():
            want = eager_prefill(model, kv, ids, positions, meta, splice)
            carry = prefill_inputs(model, ids, positions, splice, meta)
            got = runner(carry, PrefillContext(meta, kv))
        assert torch.equal(got[0], want)
    stats = runner.stats()
    assert stats["captures"] == 1 and stats["replays"] == 3 and stats["graphs"] == 3
    runner.close()
