"""Whole prefill graphs on the engine (SimBackend on CPU).

Where a kernel set's packed attention reads only the metadata's device tensors
(`whole_prefill_graphs`: the fused set's one launch on a GPU), the engine has a runner of the
prefill pipeline's whole form (`prefill_whole`): one segment, one graph per token bucket,
sequence bucket (padded with empty sequences) and table width that traffic earns; until a key
has its graph, the prefill segments answer it. A test set stands in for the fused one here:
the reference's ops, with an attention that reads the block tables, lengths and query starts
as tensors only (no host-side lengths, no host sync, so the simulated capture accepts it).
"""

from __future__ import annotations

import pytest
import torch

from bench.decode import NumberTokenizer
from graphguard.core.admission import AdmissionConfig
from graphguard.core.metrics import GraphMetrics
from graphguard.engine.config import GraphConfig
from graphguard.engine.graphs.runners import segmented_runner, whole_prefill_runner
from graphguard.engine.graphs.warmup import warm_whole_prefill
from graphguard.engine.models import build_model
from graphguard.engine.models.forward import EagerForward, dummy_prefill_inputs, prefill_inputs
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.shapes import (
    MIN_WIDTH_BLOCKS,
    prefill_seq_bucket,
    wave_seq_buckets,
    whole_prefill,
)
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.kernels import KernelSelection, TorchKernels
from tests.kv_checks import changed_slots
from tests.tiny import tiny_config
from tests.unit.engine.fixtures_engine import (  # noqa: F401
    make_engine,
    one_torch_thread,
    run_to_completion,
    token_ids_of,
)

GREEDY_SHORT = SamplingParams(temperature=0.0, max_tokens=3)


def device_prefill_attention(q, kv_cache, query_start, seq_lens, tables, scale):
    """Causal attention of packed queries over the paged cache from device tensors alone:
    each token finds its sequence among the query starts and attends over the keys of its
    table up to its own position. Dense over the table's width (fine at test sizes)."""
    k_cache, v_cache = kv_cache
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    token = torch.arange(num_tokens, device=q.device)
    seq = torch.searchsorted(query_start[1:].contiguous(), token.to(query_start.dtype), right=True)
    first = query_start[seq]
    position = seq_lens[seq] - (query_start[seq + 1] - first) + (token - first)
    lanes = torch.arange(block_size, device=q.device)
    slots = (tables[seq].long()[:, :, None] * block_size + lanes).flatten(1)  # [T, keys]
    group = num_heads // num_kv_heads

    def per_head(cache):
        rows = cache.flatten(0, 1)[slots].float()  # [T, keys, Hkv, D]
        shape = (*rows.shape[:2], num_kv_heads, group, head_dim)
        return rows[:, :, :, None, :].expand(shape).reshape(*rows.shape[:2], num_heads, head_dim)

    keys, values = per_head(k_cache), per_head(v_cache)
    scores = torch.einsum("thd,tjhd->thj", q.float(), keys) * scale
    visible = torch.arange(slots.shape[1], device=q.device)[None, :] <= position[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thj,tjhd->thd", scores.softmax(-1), values).to(q.dtype)


class WholeGraphKernels(TorchKernels):
    """The reference set with a packed attention a graph can hold (see module docstring)."""

    name = "torch-whole"
    needs_prefill_groups = False
    whole_prefill_graphs = True

    def prefill_attention(self, q, k, v, kv_cache, meta, scale):
        return device_prefill_attention(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )


@pytest.fixture(autouse=True)
def _whole_graph_kernels(one_torch_thread, monkeypatch):  # noqa: F811
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)
    selection = KernelSelection(WholeGraphKernels(), "test")
    monkeypatch.setattr("graphguard.engine.engine.select_kernels", lambda *args: selection)


def settle(engine):
    while engine.has_capture_in_flight():
        engine.step()


def run_wave(engine, prompts: dict[str, str]) -> dict[str, list[int]]:
    """The prompts added together (one prefill step), run to completion; tokens by id."""
    for rid, text in prompts.items():
        engine.add_request(rid, engine.tokenizer.encode(text), GREEDY_SHORT)
    return {rid: token_ids_of(outs) for rid, outs in run_to_completion(engine).items()}


WAVES = [
    {"a": "The capital of France is", "b": "1, 2, 3,"},  # 2 prompts and the padding sequence
    {"c": "Water boils at", "d": "Red, green and", "e": "Once upon a"},  # 3 and the padding
]


def test_a_packed_prefill_is_one_graph_and_gives_the_eager_tokens(embedded_model):
    graphs = make_engine(embedded_model, graph_backend="sim")
    eager = make_engine(embedded_model, enforce_eager=True)
    try:
        whole = graphs.graphs.prefill_whole
        assert whole.num_segments == 1 and graphs.graphs.prefill.num_segments > 1
        for wave in WAVES + WAVES:
            assert run_wave(graphs, wave) == run_wave(eager, wave)
            settle(graphs)
        stats = graphs.graphs.stats()["prefill"]["whole"]
        assert stats["replays"] >= 2 and stats["parity_mismatches"] == 0, stats
    finally:
        graphs.shutdown()
        eager.shutdown()


def test_steps_of_different_sequence_counts_share_a_key_in_their_buckets(embedded_model):
    """Two and three prompts (with the padding sequence: 3 and 4, one sequence bucket of 8)
    whose tokens share a token bucket and whose tables share a width replay one graph."""
    assert prefill_seq_bucket(3) == prefill_seq_bucket(4) == 8
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        for wave in WAVES + WAVES:
            run_wave(engine, wave)
            settle(engine)
        details = engine.graphs.stats()["prefill"]["whole"]["groups_detail"]
        assert len(details) == 1, details
        key = details[0]["key"]  # ids ... slots, then tables, lengths and query starts
        assert key.endswith(f"int32[8x{MIN_WIDTH_BLOCKS}]@cpu, int32[8]@cpu, int32[9]@cpu)"), key
    finally:
        engine.shutdown()


def test_a_padded_step_writes_only_its_prompts_slots_and_the_dummy_block(embedded_model):
    """The step's whole graph captured on its own call (warm-ups, capture and parity run on
    the real inputs, the first replay answers): its prompts' slots and the dummy block."""
    first_call = AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)
    graphs = GraphConfig(prefill_admission=first_call)
    engine = make_engine(
        embedded_model, graph_backend="sim", graphs=graphs, background_capture=False
    )
    try:
        kv, dummy = engine.kv, PagedKVStorage.DUMMY_BLOCK
        for rid, text in WAVES[1].items():
            engine.add_request(rid, engine.tokenizer.encode(text), GREEDY_SHORT)
        before = [c.clone() for c in (*kv.k_cache, *kv.v_cache)]
        engine.step()  # the three prompts' prefill, padded to 8 sequences and 16 tokens
        prompt_slots = {
            seq.block_table[p // kv.block_size] * kv.block_size + p % kv.block_size
            for seq in engine.scheduler.running
            for p in range(seq.num_prompt_tokens)
        }
        changed = changed_slots(before, [*kv.k_cache, *kv.v_cache])
        dummy_slots = set(range(dummy * kv.block_size, (dummy + 1) * kv.block_size))
        assert changed - dummy_slots == prompt_slots and changed & dummy_slots
        assert engine.graphs.stats()["prefill"]["whole"]["replays"] == 1
    finally:
        engine.shutdown()


def test_a_dummy_prefill_fills_the_key_it_is_made_for(embedded_model):
    """The inputs a capture between steps runs on (one sequence of the tokens over the dummy
    block, empty ones after it) have the key's shapes and leave the real blocks alone."""
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        model, kv = engine.model, engine.kv
        ids, positions, meta = dummy_prefill_inputs(32, kv, torch.device("cpu"), 4, 16)
        carry = prefill_inputs(model, ids, positions, None, meta, whole=True)
        assert [tuple(t.shape) for t in carry[-3:]] == [(4, 16), (4,), (5,)]
        assert meta.query_start_loc.tolist() == [0, 32, 32, 32, 32]
        assert meta.seq_lens.tolist() == [32, 0, 0, 0]
        assert (meta.block_tables == PagedKVStorage.DUMMY_BLOCK).all()
    finally:
        engine.shutdown()


def test_until_a_key_has_its_whole_graph_the_segments_answer_it(embedded_model):
    """The first wave of a shape falls back, and its answer comes from the prefill segments
    (their runner is called), timed for the payback rule against them; a later wave replays
    the whole graph and the segments are not called."""
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        graphs = engine.graphs
        run_wave(engine, WAVES[0])
        first = graphs.stats()["prefill"]
        assert first["whole"]["replays"] == 0 and first["calls"] == 1, first
        for _ in range(3):
            settle(engine)
            run_wave(engine, WAVES[0])
        later = graphs.stats()["prefill"]
        assert later["whole"]["replays"] >= 1 and later["calls"] < later["whole"]["calls"]
    finally:
        engine.shutdown()


def test_a_start_captures_the_whole_graphs_a_wave_of_continued_chunks_lands_on():
    """A start's whole graphs (EngineGraphs.warm_waves): the continued group's tokens at the
    widest width, for each sequence bucket of a wave of up to 16 rows (8 and 32), each on
    the dummy inputs of its key."""
    assert wave_seq_buckets(1) == [8] and wave_seq_buckets(16) == [8, 32]
    assert wave_seq_buckets(64) == [8, 32, 128]
    config = tiny_config(max_position_embeddings=1024)  # the dummy's positions reach 511
    model = build_model(config, dtype=torch.float32, device="cpu", seed=0)
    model.use_kernels(WholeGraphKernels())
    kv = PagedKVStorage(
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_blocks=40, block_size=4, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    forward, sim = EagerForward(model, kv), GraphConfig(backend="sim")
    segments = segmented_runner(forward, sim, "sim", GraphMetrics())
    whole = whole_prefill_runner(forward, sim, "sim", GraphMetrics(), segments)
    try:
        report = warm_whole_prefill(forward, whole, 512, 64, wave_seq_buckets(16), False)
        keys = {(g.key.args[0].shape[0], *g.key.args[-3].shape) for g in whole.groups()}
        assert keys == {(512, 8, 64), (512, 32, 64)} and len(report.captured) == 2, keys
        assert whole.policy.knows_a_price
    finally:
        whole.close()
        segments.close()


def test_a_lazy_start_prices_the_whole_runner_with_its_smallest_key(embedded_model):
    """Without a continued group to capture (this engine's contexts are short), a lazy start
    captures the smallest whole key, a short prompt and its padding at the narrowest width:
    the whole runner knows a capture's price, so the payback rule holds for its keys."""
    engine = make_engine(embedded_model, graph_backend="sim", price_captures=True)
    try:
        whole = engine.graphs.prefill_whole
        assert whole.policy.knows_a_price
        keys = [(g.key.args[0].shape[0], *g.key.args[-3].shape) for g in whole.groups()]
        assert keys == [(16, 2, MIN_WIDTH_BLOCKS)], keys
    finally:
        engine.shutdown()


def test_a_packed_prefill_above_the_launch_bound_steps_goes_to_the_segments():
    """A step of more than WHOLE_PREFILL_TOKENS (512) padded tokens is not a whole key: its
    rows, not its launches, set its cost, and the segments take it directly, unpadded in
    sequences and width (a tiny model, so that 600 tokens prefill at once)."""
    assert whole_prefill(WholeGraphKernels(), 512) and not whole_prefill(WholeGraphKernels(), 640)
    config = tiny_config(max_position_embeddings=1024)
    model = build_model(config, dtype=torch.float32, device="cpu", seed=0)
    loaded = LoadedModel("tiny", model, config, NumberTokenizer(config))
    engine = make_engine(loaded, graph_backend="sim", max_model_len=1024,
                         max_num_batched_tokens=1024, block_size=16)  # fmt: skip
    try:
        for length in (600, 40):  # 640 padded tokens, then 48
            engine.add_request(str(length), [(7 * p) % 90 + 3 for p in range(length)], GREEDY_SHORT)
            engine.step()  # the prefill
        stats = engine.graphs.stats()["prefill"]
        assert stats["whole"]["calls"] == 1 and stats["calls"] == 2, stats
    finally:
        engine.shutdown()
