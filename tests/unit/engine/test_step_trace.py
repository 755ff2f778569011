"""GRAPHGUARD_STEP_TRACE: one JSON line per request added and per step, on the wall clock."""

from __future__ import annotations

import json
import time

from graphguard.engine.step.step_trace import TRACE_ENV
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion


def test_the_trace_lists_each_request_added_and_each_step(embedded_model, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    engine = make_engine(embedded_model, graph_backend="sim")
    before = time.time()
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
        run_to_completion(engine)
        num_steps = engine.stats()["num_steps"]
    finally:
        engine.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["event"] == "add" and lines[0]["prompt_tokens"] == 3
    steps = [line for line in lines if line["event"] == "step"]
    assert len(steps) == num_steps == 3
    assert [s["outputs"] for s in steps] == [1, 1, 1] and steps[-1]["running"] == 0
    assert all(before <= line["unix"] <= time.time() and line.get("ms", 0) >= 0 for line in lines)


def test_no_trace_without_the_setting(embedded_model, tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    engine = make_engine(embedded_model, graph_backend="sim")
    try:
        assert engine._trace is None
    finally:
        engine.shutdown()
    assert list(tmp_path.iterdir()) == []
