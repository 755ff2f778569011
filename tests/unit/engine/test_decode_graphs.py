"""Decode graphs on the engine (SimBackend on CPU): same tokens, capability proof, lifecycle."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.config import GraphConfig, engine_config
from graphguard.engine.graphs.component import EngineGraphs, GraphCapability, check_capability
from graphguard.engine.models.forward import EagerForward
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.shapes import (
    MIN_WIDTH_BLOCKS,
    prefill_token_bucket,
    warmup_prefill_tokens,
    warmup_shapes,
    width_bucket,
)
from graphguard.engine.tokens.sampling import SamplingParams
from tests.kv_checks import changed_slots, last_decode_slots
from tests.unit.engine.fixtures_engine import (  # noqa: F401
    GREEDY,
    make_engine,
    one_torch_thread,
    run_to_completion,
    token_ids_of,
)

PROMPTS = {
    "a": "The capital of France is",
    "b": "1, 2, 3, 4,",
    "c": "Water boils at a temperature of",
}


@pytest.fixture(autouse=True)
def _threads(one_torch_thread, monkeypatch):  # noqa: F811
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


def generate(engine, max_tokens=8, prompts=PROMPTS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for rid, text in prompts.items():
        engine.add_request(rid, engine.tokenizer.encode(text), params)
    outputs = run_to_completion(engine)
    return {rid: token_ids_of(outs) for rid, outs in outputs.items()}


def settle(engine):
    """Step until no graph capture is in flight between steps (captures advance one unit per
    step; idle steps finish them, as the server's engine loop does)."""
    while engine.has_capture_in_flight():
        engine.step()


def test_graphs_on_give_the_same_tokens_as_graphs_off(embedded_model):
    eager = make_engine(embedded_model, enforce_eager=True)
    graphs = make_engine(embedded_model, graph_backend="sim")
    try:
        assert isinstance(graphs.graphs, EngineGraphs)
        assert generate(graphs) == generate(eager)
        stats = graphs.graphs.stats()
        assert stats["replays"] > 0 and stats["captures"] > 0
    finally:
        eager.shutdown()
        graphs.shutdown()


def test_auto_backend_on_cpu_reports_no_cuda(embedded_model):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    engine = make_engine(embedded_model)
    try:
        assert engine.graphs is None
        assert engine.graphs_off_reason == GraphCapability.NO_CUDA.value
    finally:
        engine.shutdown()


def test_enforce_eager_reports_its_reason(embedded_model):
    engine = make_engine(embedded_model, enforce_eager=True, graph_backend="sim")
    try:
        assert engine.graphs is None and engine.graphs_off_reason == "enforce_eager"
    finally:
        engine.shutdown()


def test_kill_switch_at_start_keeps_graphs_off(embedded_model, monkeypatch):
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        assert engine.graphs is None and engine.graphs_off_reason == "kill_switch"
    finally:
        engine.shutdown()


def test_kv_identity_mismatch_keeps_graphs_off(embedded_model):
    other_kv = PagedKVStorage(
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        num_blocks=2,
        block_size=4,
        dtype=torch.float32,
        device="cpu",
    )
    forward = EagerForward(embedded_model.model, other_kv)
    sim = GraphConfig(backend="sim")
    cpu = torch.device("cpu")
    assert check_capability(sim, forward, other_kv, cpu) is GraphCapability.ENABLED
    # the scheduler allocating from one KV while attention writes another: graphs stay off
    scheduler_kv = object()
    assert check_capability(sim, forward, scheduler_kv, cpu) is GraphCapability.KV_IDENTITY_MISMATCH


def test_kill_switch_mid_run_falls_back_at_the_next_step(embedded_model, monkeypatch):
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        engine.add_request(
            "a",
            engine.tokenizer.encode(PROMPTS["a"]),
            SamplingParams(temperature=0.0, max_tokens=12),
        )
        for _ in range(5):
            engine.step()
        replays = engine.graphs.stats()["replays"]
        monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
        engine.step()
        stats = engine.graphs.stats()
        assert stats["replays"] == replays and stats["fallbacks"].get("kill_switch") == 1
    finally:
        engine.shutdown()


def test_reload_invalidates_graphs_before_the_new_weights_are_used(embedded_model):
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        generate(engine, max_tokens=4, prompts={"a": PROMPTS["a"]})
        settle(engine)
        assert engine.graphs.stats()["entries"] > 0
        captured = engine.graphs.decode._cache.entries()
        seen = []
        load = engine.model.load_state_dict

        def watching_load(*args, **kwargs):
            seen.append(all(e.is_retired for e in captured))
            return load(*args, **kwargs)

        engine.model.load_state_dict = watching_load  # type: ignore[method-assign]
        engine.reload_weights(engine.model.state_dict())
        assert seen == [True]  # every graph was retired before the new weights were loaded
        assert engine.graphs.stats()["evictions"] > 0
    finally:
        engine.shutdown()


def test_padded_rows_write_only_the_dummy_block(embedded_model):
    settings = {"graph_backend": "sim", "batch_buckets": (4,), "background_capture": False}
    engine = make_engine(embedded_model, **settings)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        engine.add_request("b", engine.tokenizer.encode(PROMPTS["b"]), params)
        engine.step()  # prefill
        engine.step()  # first decode: seen once, runs eagerly
        engine.step()  # second decode: captures the 4-row graph
        kv, dummy = engine.kv, PagedKVStorage.DUMMY_BLOCK
        for cache in (*kv.k_cache, *kv.v_cache):
            cache[dummy].fill_(7.0)  # a sentinel the padded rows must overwrite
        before = [c.clone() for c in (*kv.k_cache, *kv.v_cache)]
        engine.step()  # one real row, three padded rows, replayed from the graph
        assert engine.graphs.stats()["replays"] >= 2
        changed = changed_slots(before, [*kv.k_cache, *kv.v_cache])
        real_slots = last_decode_slots(engine)
        dummy_slots = set(range(dummy * kv.block_size, (dummy + 1) * kv.block_size))
        assert changed - dummy_slots == real_slots  # only the real row's new token's slot
        assert changed & dummy_slots  # the padded rows wrote into the dummy block
    finally:
        engine.shutdown()


def test_prefill_graphs_can_be_off_while_decode_graphs_stay_on(embedded_model):
    engine = make_engine(embedded_model, graph_backend="sim", prefill_graphs=False)
    try:
        assert isinstance(engine.graphs, EngineGraphs) and engine.graphs.prefill is None
        assert engine.runner.graphs is engine.graphs
        generate(engine, max_tokens=3, prompts={"a": PROMPTS["a"]})
        settle(engine)
        generate(engine, max_tokens=3, prompts={"a": PROMPTS["a"]})
        assert engine.graphs.stats()["replays"] > 0
    finally:
        engine.shutdown()
    default = make_engine(embedded_model, graph_backend="sim")
    try:
        assert default.graphs is not None and default.graphs.prefill is not None
        assert default.runner.graphs is default.graphs
    finally:
        default.shutdown()


def test_shutdown_releases_graphs(embedded_model):
    engine = make_engine(embedded_model, graph_backend="sim")
    generate(engine, max_tokens=3, prompts={"a": PROMPTS["a"]})
    settle(engine)
    graphs = engine.graphs
    assert graphs.stats()["entries"] > 0
    engine.shutdown()
    engine.shutdown()
    assert graphs.stats()["entries"] == 0 and graphs.stats()["closed"]


def test_warmup_captures_all_padding_keys_largest_first(embedded_model):
    engine = make_engine(embedded_model, graph_backend="sim", batch_buckets=(1, 2))
    try:
        report = engine.graphs.warm_decode(batch_sizes=(1, 2), widths=(1, 2), progress=False)
        assert len(report.captured) == 4 and not report.skipped
        assert engine.kv.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_warmup_shapes_cover_every_batch_and_length_the_engine_can_decode():
    config = engine_config(
        max_num_seqs=5, max_model_len=100, block_size=16, batch_buckets=(1, 2, 4, 8, 16)
    )
    batch_sizes, widths = warmup_shapes(config)
    # 5 rows pad up to 8, so 16 is never used; 100 tokens fill 7 blocks, padded to width 8.
    assert batch_sizes == [1, 2, 4, 8] and widths == [MIN_WIDTH_BLOCKS] == [8]
    for length in range(1, config.max_model_len + 1):
        assert width_bucket(-(-length // config.block_size)) in widths
    wide = engine_config(max_num_seqs=40, max_model_len=600, batch_buckets=(1, 16))
    assert warmup_shapes(wide) == ([1, 16], [8, 16, 32, 64])
    # The engine's own limit (the model's positions) bounds the widths, not the config's.
    assert warmup_shapes(wide, max_model_len=200) == ([1, 16], [8, 16])


def test_warmup_graphs_at_start_leaves_nothing_to_capture_while_serving(embedded_model):
    settings = {"graph_backend": "sim", "batch_buckets": (1, 2, 4), "max_model_len": 16}
    engine = make_engine(embedded_model, warmup_graphs=True, max_num_batched_tokens=64, **settings)
    eager = make_engine(embedded_model, enforce_eager=True, max_model_len=16)
    try:
        before = engine.graphs.stats()
        # Buckets 1, 2, 4 (max_num_seqs 4) by one width: 16 tokens in blocks of 4 fill 4
        # blocks, under the narrowest table (MIN_WIDTH_BLOCKS).
        assert before["entries"] == before["captures"] == 3
        assert before["replays"] == 0 and engine.kv.num_used_blocks == 0
        # and the prefill groups of the token buckets up to the step's budget: 16, 32, 64
        assert before["prefill"]["groups"] == before["prefill"]["captures"] == 3
        assert generate(engine) == generate(eager)
        after = engine.graphs.stats()
        assert after["captures"] == 3 and after["replays"] > 0 and after["fallbacks"] == {}
        prefill = after["prefill"]
        assert prefill["captures"] == 3 and prefill["replays"] > 0 and prefill["fallbacks"] == {}
    finally:
        engine.shutdown()
        eager.shutdown()


def test_graph_stats_report_kv_bytes_next_to_graph_bytes(embedded_model):
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        generate(engine, max_tokens=3, prompts={"a": PROMPTS["a"]})
        settle(engine)
        stats = engine.graphs.stats()
        assert stats["kv_bytes"] == engine.kv.kv_bytes and stats["resident_bytes"] > 0
        assert stats["graphs"][0]["verified"] == "exact"
    finally:
        engine.shutdown()


def test_prefills_of_nearby_lengths_share_one_prefill_graph(embedded_model):
    graphs = make_engine(embedded_model, graph_backend="sim")
    eager = make_engine(embedded_model, enforce_eager=True)
    try:
        for words in (3, 4, 5):  # 9-13 prompt tokens: one 16-token bucket
            prompt = {"q": " ".join(["one"] * words) + " two"}
            assert generate(graphs, max_tokens=2, prompts=prompt) == generate(
                eager, max_tokens=2, prompts=prompt
            )
            settle(graphs)
        prefill = graphs.graphs.stats()["prefill"]
        assert prefill["groups"] == 1 and prefill["captures"] == 1, prefill
        assert prefill["replays"] >= 1  # the third prompt replayed the second one's graph
    finally:
        graphs.shutdown()
        eager.shutdown()


def test_prefill_padding_writes_only_the_dummy_block(embedded_model):
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        ids = engine.tokenizer.encode(PROMPTS["c"])
        assert prefill_token_bucket(len(ids)) > len(ids)  # the step below is padded
        engine.add_request("c", ids, SamplingParams(temperature=0.0, max_tokens=2))
        kv, dummy = engine.kv, PagedKVStorage.DUMMY_BLOCK
        before = [c.clone() for c in (*kv.k_cache, *kv.v_cache)]
        engine.step()  # the prefill
        (seq,) = engine.scheduler.running
        prompt_slots = {
            seq.block_table[p // kv.block_size] * kv.block_size + p % kv.block_size
            for p in range(len(ids))
        }
        changed = changed_slots(before, [*kv.k_cache, *kv.v_cache])
        dummy_slots = set(range(dummy * kv.block_size, (dummy + 1) * kv.block_size))
        assert changed - dummy_slots == prompt_slots and changed & dummy_slots
    finally:
        engine.shutdown()


def test_short_sequences_share_the_narrowest_decode_width():
    # One graph width for every sequence up to MIN_WIDTH_BLOCKS blocks, not one per power of two.
    assert {width_bucket(n) for n in range(1, MIN_WIDTH_BLOCKS + 1)} == {MIN_WIDTH_BLOCKS}
    assert width_bucket(MIN_WIDTH_BLOCKS + 1) == 2 * MIN_WIDTH_BLOCKS


def test_a_wave_of_prompts_split_over_two_steps_lands_on_few_prefill_keys():
    # 16 prompts of 9 tokens that arrive across two steps, split at any point: each step's
    # packed count pads to a power of two, so every split shares five keys (the counts 9-135
    # would give 13 keys at four buckets per octave).
    keys = {prefill_token_bucket(9 * k) for k in range(1, 16)}
    keys |= {prefill_token_bucket(9 * (16 - k)) for k in range(1, 16)}
    assert keys == {16, 32, 64, 128, 256}


def test_prefill_buckets_cover_their_count_and_pad_long_prompts_by_under_a_quarter():
    for n in range(1, 5000):
        bucket = prefill_token_bucket(n)
        assert bucket >= n and bucket >= prefill_token_bucket(n - 1 or 1)
        if n > 512:
            assert bucket - n < n / 4, n


def test_a_warm_start_captures_the_power_of_two_prefill_buckets_within_a_steps_budget():
    assert warmup_prefill_tokens(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert warmup_prefill_tokens(600) == [16, 32, 64, 128, 256, 512, 1024]
    assert warmup_prefill_tokens(100) == [16, 32, 64, 128]  # 100 tokens pad to 128
    assert warmup_prefill_tokens(8) == [16]
    for budget in (8, 100, 700, 4096):
        for n in range(1, min(budget, 512) + 1):  # every prefill a step can pack, to 512
            assert prefill_token_bucket(n) in warmup_prefill_tokens(budget)


def test_a_batch_without_its_graph_rides_a_larger_one_and_writes_only_its_own_slots(
    embedded_model,
):
    eager = make_engine(embedded_model, enforce_eager=True)
    engine = make_engine(embedded_model, graph_backend="sim", batch_buckets=(1, 2, 4))
    try:
        engine.graphs.warm_decode([4], [MIN_WIDTH_BLOCKS], progress=False)
        prompt = {"b": PROMPTS["b"]}
        params = SamplingParams(temperature=0.0, max_tokens=6)
        engine.add_request("b", engine.tokenizer.encode(PROMPTS["b"]), params)
        engine.step()  # prefill
        kv, dummy = engine.kv, PagedKVStorage.DUMMY_BLOCK
        before = [c.clone() for c in (*kv.k_cache, *kv.v_cache)]
        engine.step()  # one real row in the 4-row graph, three rows of padding
        stats = engine.graphs.stats()
        assert (stats["replays"], stats["covered"], stats["fallbacks"]) == (1, 1, {})
        changed = changed_slots(before, [*kv.k_cache, *kv.v_cache])
        dummy_slots = set(range(dummy * kv.block_size, (dummy + 1) * kv.block_size))
        assert changed - dummy_slots == last_decode_slots(engine)
        tokens = token_ids_of(run_to_completion(engine)["b"])
        engine.add_request("b2", engine.tokenizer.encode(PROMPTS["b"]), params)
        again = token_ids_of(run_to_completion(engine)["b2"])
        assert again == generate(eager, max_tokens=6, prompts=prompt)["b"]
        assert len(tokens) == 4  # the rest of "b": every decode step rode the 4-row graph
        assert engine.graphs.stats()["covered"] == engine.graphs.stats()["replays"] == 10
    finally:
        eager.shutdown()
        engine.shutdown()
