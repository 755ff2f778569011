"""The engine's captures pay back: a lazy start prices captures of each kind, and a key that
traffic earns is captured only once its eager steps have cost that price (the admission's
payback rule, graphguard/core/admission.py). Captures are made slow on purpose (SimBackend)."""

from __future__ import annotations

from graphguard.core.admission import AdmissionConfig
from graphguard.engine.config import GraphConfig
from graphguard.engine.kv import MIN_WIDTH_BLOCKS
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion
from tests.unit.engine.test_background_capture import (  # noqa: F401
    SLOW_S,
    add,
    settle,
    slow_capture,
    tiny,
)


def decode_key_rows(engine) -> list[int]:
    return sorted(key.rows for key in engine.graphs.decode.runner.admitted_keys())


def test_a_lazy_start_prices_captures_of_each_kind(tiny, slow_capture):  # noqa: F811
    engine = make_engine(tiny, graph_backend="sim", price_captures=True)
    try:
        decode, prefill = engine.graphs.decode.runner, engine.graphs.prefill.runner
        stats = engine.graphs.stats()
        # the decode ladder at the narrowest block table: the bucket that holds max_num_seqs,
        # 4, answers batches down to 1 at a pad factor of 16; the smallest prefill group
        # (this kernel set runs no prefill as rows)
        assert stats["captures"] == 1 and stats["prefill"]["captures"] == 1
        assert decode_key_rows(engine) == [4]
        (key,) = decode.admitted_keys()
        assert key.args[2].shape == (4, MIN_WIDTH_BLOCKS)  # the block table's
        assert engine.kv.num_used_blocks == 0
        # both prices are known before any request: at least the slow capture itself
        assert decode.policy.price(None) >= SLOW_S  # type: ignore[arg-type]
        assert prefill.policy.price(None) >= SLOW_S  # type: ignore[arg-type]
        # a request of one row rides the priced graph from its first decode step
        add(engine, "a", max_tokens=6)
        run_to_completion(engine)
        after = engine.graphs.stats()
        assert after["replays"] == after["covered"] == 5 and after["fallbacks"] == {}
    finally:
        engine.shutdown()


def test_a_key_whose_steps_cost_less_than_a_capture_is_never_captured(tiny, slow_capture):  # noqa: F811
    # no pad-up: the lazy start prices the smallest key alone, and two rows step eagerly
    no_cover = GraphConfig(decode_pad_factor=1)
    engine = make_engine(
        tiny, graph_backend="sim", prefill_graphs=False, price_captures=True, graphs=no_cover
    )
    try:
        add(engine, "a", max_tokens=12)
        add(engine, "b", max_tokens=12)
        run_to_completion(engine)
        settle(engine)
        stats = engine.graphs.stats()
        # eleven eager steps of two rows cost far less than a slow capture: no capture
        assert decode_key_rows(engine) == [1]
        assert stats["fallbacks"] == {"admission_deferred": 11}
        assert stats["admission"]["awaiting_payback"] >= 10
    finally:
        engine.shutdown()


def test_without_payback_the_same_steps_earn_a_capture(tiny, slow_capture):  # noqa: F811
    graphs = GraphConfig(admission=AdmissionConfig())
    engine = make_engine(
        tiny, graph_backend="sim", prefill_graphs=False, price_captures=True, graphs=graphs
    )
    try:
        add(engine, "a", max_tokens=12)
        add(engine, "b", max_tokens=12)
        run_to_completion(engine)
        settle(engine)
        assert decode_key_rows(engine) == [2, 4]  # its steps rode the 4-row graph meanwhile
    finally:
        engine.shutdown()
