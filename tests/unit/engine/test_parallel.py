"""Tensor parallelism on the CPU: two ranks (gloo) over the embedded model, SimBackend graphs.

Rank 0 runs in a spawned process (tests/parallel_cases.py) and starts rank 1 as the server
does; the test reads what rank 0 saw and what rank 1 reported at shutdown.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from graphguard.engine.config import ModelConfig
from graphguard.engine.models.parallel_layers import split_range
from graphguard.engine.models.shard import shard_plan
from graphguard.engine.tokens.sampling import SamplingParams
from tests.parallel_cases import NUM_TOKENS, PROMPT, run_leader
from tests.tiny import tiny_config
from tests.unit.engine.fixtures_engine import (  # noqa: F401
    make_engine,
    one_torch_thread,
    run_to_completion,
)

SCENARIO_TIMEOUT_S = 120
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the single-process engine's steps


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start each rank on one intra-op thread (each spawned process reads the variable when it
    imports torch). Two ranks of two spinning threads each on a 2-core machine made a
    scenario's steps about 4x slower (fixtures_engine.one_torch_thread says why)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def run_scenario(scenario: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    leader = context.Process(target=run_leader, args=(scenario, queue, env or {}))
    leader.start()
    leader.join(SCENARIO_TIMEOUT_S)
    if leader.is_alive():
        leader.kill()
        pytest.fail(f"scenario {scenario} did not end in {SCENARIO_TIMEOUT_S} s")
    assert not queue.empty(), f"scenario {scenario} reported nothing (exit {leader.exitcode})"
    return queue.get()


def run_against_one_process(scenario: str, embedded_model: Any) -> dict[str, Any]:
    """`scenario`'s report, once its tokens and logprobs are checked against one process's."""
    tokens, logprobs = single_process(embedded_model)
    report = run_scenario(scenario)
    assert report["tokens"] == tokens
    assert report["logprobs"] == pytest.approx(logprobs, abs=1e-3)
    return report


def single_process(embedded_model: Any) -> tuple[list[int], list[float]]:
    engine = make_engine(embedded_model, enforce_eager=True)
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    engine.add_request("alone", ids, params)
    outputs = run_to_completion(engine)["alone"]
    engine.shutdown()
    tokens = [t for out in outputs for t in out.new_token_ids]
    return tokens, [lp.logprob for out in outputs for lp in out.logprobs or []]


def test_heads_split_by_kv_groups_unevenly_when_they_must():
    config = tiny_config(num_heads=9, num_kv_heads=3, head_dim=8, vocab_size=97)
    plans = [shard_plan(config, 2, rank) for rank in range(2)]
    assert [p.kv_heads for p in plans] == [range(0, 2), range(2, 3)]
    assert [p.q_heads for p in plans] == [range(0, 6), range(6, 9)]
    assert [p.vocab for p in plans] == split_range(97, 2)


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    config = tiny_config(num_heads=8, num_kv_heads=2)
    plans = [shard_plan(config, 4, rank) for rank in range(4)]
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [p.q_heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_heads_that_cannot_split_are_refused():
    config: ModelConfig = tiny_config(num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="do not split"):
        shard_plan(config, 2 * 3 * 2, 0)


def test_two_ranks_decode_the_single_process_tokens_through_replayed_graphs(embedded_model):
    report = run_against_one_process("generate", embedded_model)
    (follower,) = report["follower_reports"]
    for stats in (report["leader"], follower):
        assert stats["captures"] == 1 and stats["replays"] == NUM_TOKENS - 1
    assert report["exit_codes"] == [0]
    # What the ranks cannot do together yet is refused on rank 0, with the reason.
    reload, image = report["refused"]
    assert reload.startswith("RuntimeError") and "tensor parallelism" in reload
    assert image.startswith("ValueError") and "tensor parallelism" in image


def test_a_shared_prefix_is_reused_and_every_rank_agrees():
    report = run_scenario("shared_prefix")
    assert "error" not in report, report.get("error")
    assert report["second"] == report["first"] and report["exit_codes"] == [0]
    assert report["prefix_cache"]["hit_tokens"] > 0


def test_capture_failure_on_rank_1_only_quarantines_the_key_on_both_ranks():
    report = run_scenario("capture_fails_on_rank_1")
    (follower,) = report["follower_reports"]
    for stats in (report["leader"], follower):
        assert stats["capture_failures"] >= 1 and stats["admission"]["quarantines"] >= 1
        assert stats["entries"] == 0
    for counter in ("capture_failures", "quarantined_keys"):
        assert report["leader"][counter] == follower[counter]
    assert report["leader"]["admission"]["quarantines"] == follower["admission"]["quarantines"]
    assert report["leader"]["fallbacks"] == follower["fallbacks"]
    assert "capture_failed" in follower["fallbacks"]


def test_a_graph_over_a_small_budget_is_refused_on_both_ranks():
    report = run_scenario("small_budget")
    (follower,) = report["follower_reports"]
    for stats in (report["leader"], follower):
        assert stats["entries"] == 0 and stats["fallbacks"].get("over_budget", 0) >= 1
    assert report["leader"]["fallbacks"] == follower["fallbacks"]


def test_kill_switch_on_rank_0_alone_turns_graphs_off_on_both_ranks():
    report = run_scenario("kill_switch_midway")
    (follower,) = report["follower_reports"]
    for stats in (report["leader"], follower):
        assert stats["fallbacks"].get("kill_switch") == NUM_TOKENS - 1
    assert report["leader"]["fallbacks"] == follower["fallbacks"]


def test_a_batch_rides_the_larger_graph_its_leader_chose_on_both_ranks(embedded_model):
    report = run_against_one_process("covered", embedded_model)
    (follower,) = report["follower_reports"]
    for stats in (report["leader"], follower):
        # the first 1-row step rode the 2-row graph; the second earned the 1-row key's own
        assert stats["covered"] == 1 and stats["captures"] == 2
    assert report["leader"]["replays"] == follower["replays"]
    assert report["leader"]["fallbacks"] == follower["fallbacks"]


def test_a_crashed_follower_ends_rank_0_with_a_clear_error():
    report = run_scenario("follower_crash")
    assert report["error"] is not None and "RanksLost" in report["error"]
    assert "rank 1 exited" in report["error"]
