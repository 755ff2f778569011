"""No request waits for a capture: with background capture (the default) a key that traffic
earns is captured between steps, in units of work, while its steps run eagerly with
`capture_in_progress`; no unit runs in a step that prefills a waiting request (within a bound);
the graph replays once admitted; reload and shutdown cancel a capture in flight. The captures
here are made slow on purpose (SimBackend.capture sleeps)."""

from __future__ import annotations

import time

import pytest
import torch

from graphguard.core.sim import SimBackend
from graphguard.engine.config import CapturePacing, GraphConfig
from graphguard.engine.engine import LLMEngine
from graphguard.engine.models import build_model
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from tests.tiny import tiny_config
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion, token_ids_of

TINY = tiny_config(vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=512)
SLOW_S = 0.2  # each simulated capture (one graph, or one segment of a prefill group)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture
def tiny(embedded_model: LoadedModel) -> LoadedModel:
    model = build_model(TINY, dtype=torch.float32, device="cpu", seed=0)
    return LoadedModel("tiny", model, TINY, embedded_model.tokenizer)


@pytest.fixture
def slow_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    capture = SimBackend.capture

    def slow(self, fn, args, *, pool, stream, holes=()):
        time.sleep(SLOW_S)
        return capture(self, fn, args, pool=pool, stream=stream, holes=holes)

    monkeypatch.setattr(SimBackend, "capture", slow)
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


def add(engine: LLMEngine, rid: str, max_tokens: int = 12) -> None:
    engine.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def step_until_capture_in_flight(engine: LLMEngine) -> None:
    for _ in range(20):
        engine.step()
        if engine.has_capture_in_flight():
            return
    raise AssertionError("no capture started")


def settle(engine: LLMEngine) -> None:
    while engine.has_capture_in_flight():
        engine.step()


def test_requests_are_answered_eagerly_while_a_slow_capture_is_in_flight(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim")
    eager = make_engine(tiny, enforce_eager=True)
    try:
        add(engine, "a")
        tokens: list[int] = []
        steps_in_flight, longest_s = 0, 0.0
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            outputs = engine.step()
            longest_s = max(longest_s, time.perf_counter() - started)
            tokens += [t for out in outputs for t in out.new_token_ids]
            if engine.has_capture_in_flight() and outputs:
                steps_in_flight += 1
        add(eager, "a")
        assert tokens == token_ids_of(run_to_completion(eager)["a"])
        stats = engine.graphs.stats()
        # Tokens came while a capture was in flight, each step held up by one unit at most.
        assert steps_in_flight >= 2 and stats["fallbacks"]["capture_in_progress"] >= 2
        assert longest_s < 2 * SLOW_S
        assert stats["calls"] == stats["replays"] + sum(stats["fallbacks"].values())
    finally:
        engine.shutdown()
        eager.shutdown()


def test_the_graph_captured_between_steps_is_used_afterwards(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim")
    try:
        add(engine, "a", max_tokens=4)
        run_to_completion(engine)
        settle(engine)  # idle steps finish what traffic started
        decode = engine.graphs.stats()
        assert decode["entries"] >= 1 and decode["replays"] == 0
        add(engine, "b", max_tokens=4)
        run_to_completion(engine)
        # the decode steps of "b" at the captured (batch, width) key replay it
        assert engine.graphs.stats()["replays"] >= 2
    finally:
        engine.shutdown()


def test_a_capture_in_flight_holds_its_bytes_until_it_ends(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim", prefill_graphs=False)
    try:
        add(engine, "a")
        step_until_capture_in_flight(engine)
        reserved = []
        while engine.has_capture_in_flight():
            engine.step()
            reserved.append(engine.graphs.stats()["reserved_bytes"])
        assert max(reserved) > 0  # the candidate's bytes, once captured
        stats = engine.graphs.stats()
        assert stats["reserved_bytes"] == 0 and stats["resident_bytes"] <= stats["max_bytes"]
    finally:
        engine.shutdown()


def test_reload_cancels_the_capture_in_flight(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim", prefill_graphs=False)
    try:
        add(engine, "a")
        step_until_capture_in_flight(engine)
        backend = engine.graphs.decode.backend
        engine.reload_weights({k: v * 0.5 for k, v in engine.model.state_dict().items()})
        stats = engine.graphs.stats()
        assert not engine.has_capture_in_flight() and stats["captures_cancelled"] == 1
        assert stats["reserved_bytes"] == 0 and stats["entries"] == 0
        assert not backend.live_streams  # the candidate's stream and pool went back
        run_to_completion(engine)  # keys are earned again, on the new weights
        settle(engine)
        assert engine.graphs.stats()["captures"] >= 1
    finally:
        engine.shutdown()


def test_shutdown_cancels_the_capture_in_flight(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim")
    add(engine, "a")
    step_until_capture_in_flight(engine)
    graphs = engine.graphs
    backend = graphs.decode.backend
    engine.shutdown()
    assert not graphs.has_capture_in_flight and not engine.has_capture_in_flight()
    assert graphs.stats()["captures_cancelled"] + graphs.stats()["prefill"]["captures_cancelled"]
    assert not backend.live_streams


def test_the_kill_switch_cancels_the_capture_in_flight_at_the_next_step(
    tiny, slow_capture, monkeypatch
):
    engine = make_engine(tiny, graph_backend="sim", prefill_graphs=False)
    try:
        add(engine, "a")
        step_until_capture_in_flight(engine)
        monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
        engine.step()
        stats = engine.graphs.stats()
        assert not engine.has_capture_in_flight() and stats["captures_cancelled"] == 1
        assert stats["fallbacks"]["kill_switch"] == 1
    finally:
        engine.shutdown()


def test_without_background_capture_the_earning_step_captures_in_place(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim", background_capture=False)
    try:
        add(engine, "a", max_tokens=4)
        run_to_completion(engine)
        stats = engine.graphs.stats()
        assert "capture_in_progress" not in stats["fallbacks"] and stats["captures"] == 1
        assert not engine.has_capture_in_flight()
    finally:
        engine.shutdown()


def test_no_unit_runs_in_a_step_that_prefills_a_waiting_request(tiny, slow_capture):
    engine = make_engine(tiny, graph_backend="sim", prefill_graphs=False)
    try:
        add(engine, "a")
        step_until_capture_in_flight(engine)  # its next unit is the (slow) capture
        backend = engine.graphs.decode.backend
        captures = backend.num_captures
        add(engine, "b")
        outputs = engine.step()
        assert [out.request_id for out in outputs if out.new_token_ids] == ["a", "b"]
        assert backend.num_captures == captures  # b's first token did not wait for it
        engine.step()  # nothing pending: the capture goes on
        assert backend.num_captures == captures + 1
        assert engine.graphs.stats()["capture_steps_deferred"] == 1
    finally:
        engine.shutdown()


def test_a_queue_that_never_empties_puts_a_capture_off_a_bounded_number_of_steps(
    tiny, slow_capture
):
    steps_only = CapturePacing(max_deferred_steps=2, max_deferred_ms=0.0)  # steps, not time
    pacing = GraphConfig(capture_pacing=steps_only)
    engine = make_engine(
        tiny, graph_backend="sim", prefill_graphs=False, max_num_seqs=1, graphs=pacing
    )
    try:
        add(engine, "a", max_tokens=20)
        step_until_capture_in_flight(engine)
        backend = engine.graphs.decode.backend
        captures = backend.num_captures
        add(engine, "b")  # waits behind "a" (one sequence at a time)
        counts = []
        for _ in range(3):
            engine.step()
            counts.append(backend.num_captures - captures)
        assert counts == [0, 0, 1]
    finally:
        engine.shutdown()


def test_short_units_of_a_step_run_together_within_its_slice(tiny):
    whole = GraphConfig(capture_pacing=CapturePacing(slice_ms=1e6))
    engine = make_engine(tiny, graph_backend="sim", prefill_graphs=False, graphs=whole)
    try:
        add(engine, "a")
        step_until_capture_in_flight(engine)
        engine.step()  # the whole capture, every unit, before this step
        stats = engine.graphs.stats()
        assert stats["captures"] == 1 and stats["background_units"] >= 2
    finally:
        engine.shutdown()
