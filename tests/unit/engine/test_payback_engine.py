"""The engine's captures pay back: a lazy start prices captures of each kind, and a key that
traffic earns is captured only once its eager steps have cost that price (the admission's
payback rule, graphguard/core/admission.py). Captures are made slow on purpose (SimBackend)."""

from __future__ import annotations

from graphguard.core.admission import AdmissionConfig
from graphguard.engine.config import GraphConfig
from graphguard.engine.shapes import MIN_WIDTH_BLOCKS, warmup_shapes
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion
from tests.unit.engine.test_background_capture import (  # noqa: F401
    SLOW_S,
    add,
    settle,
    slow_capture,
    tiny,
)


def decode_key_rows(engine) -> list[int]:
    return sorted(key.rows for key in engine.graphs.decode.admitted_keys())


def test_a_lazy_start_prices_captures_of_each_kind(tiny, slow_capture):  # noqa: F811
    engine = make_engine(tiny, graph_backend="sim", price_captures=True)
    try:
        decode, prefill = engine.graphs.decode, engine.graphs.prefill
        stats = engine.graphs.stats()
        # the decode ladder at each block-table width: the bucket that holds max_num_seqs,
        # 4, answers batches down to 1 at a pad factor of 16; the smallest prefill group
        # (this kernel set runs no prefill as rows)
        _, widths = warmup_shapes(engine.config)
        assert widths == [MIN_WIDTH_BLOCKS, 2 * MIN_WIDTH_BLOCKS]
        assert stats["captures"] == 2 and stats["prefill"]["captures"] == 1
        tables = sorted(tuple(key.args[2].shape) for key in decode.admitted_keys())
        assert tables == [(4, width) for width in widths]
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
        # eleven eager steps of two rows cost far less than a slow capture: no capture (the
        # price's key, one row, at each of the two widths)
        assert decode_key_rows(engine) == [1, 1]
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
        # its steps rode the 4-row graph meanwhile (the ladder's, at each of the two widths)
        assert decode_key_rows(engine) == [2, 4, 4]
    finally:
        engine.shutdown()
