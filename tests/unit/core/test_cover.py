"""A call whose bucket has no graph yet replays a larger admitted bucket instead of running
eagerly (CaptureConfig(max_pad_factor=...)): its answer is its own rows' answer, it counts as a
replay (`covered`), its own key still earns a graph, and only a key that is waiting for its
capture is covered, never one that failed or does not fit."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.core.decisions import Action
from graphguard.core.keys import pad_ladder
from graphguard.core.reasons import FallbackReason
from graphguard.core.sim import SimBackend
from tests.unit.core.conftest import inputs, mlp_step
from tests.unit.core.stand_ins import kernel
from tests.unit.core.test_background import EAGER_FIRST, assert_same, drain

BUCKETS = gg.Buckets(batch=[2, 4, 8, 16], pad_value=-3.0)


@pytest.fixture
def backend() -> SimBackend:
    return SimBackend(num_warmup=1)


@pytest.fixture
def make_covering(make_runner, backend):
    def make(fn=mlp_step, factor: int = 4, **kwargs):
        kwargs.setdefault("admission", EAGER_FIRST)
        kwargs.setdefault("background", True)
        runner = make_runner(fn, backend=backend, buckets=BUCKETS, max_pad_factor=factor, **kwargs)
        runner.warmup([inputs(8)], progress=False)  # the one admitted graph: 8 rows
        return runner

    return make


def test_a_call_without_its_graph_replays_a_larger_admitted_bucket(make_covering):
    rows_run: list[int] = []
    log_rows = kernel(lambda x: rows_run.append(x.shape[0]))  # a replay runs the graph's rows

    def step(x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mlp_step(log_rows(x), pos)

    runner = make_covering(fn=step)
    rows_run.clear()
    x, pos = inputs(2, seed=1)
    assert_same(runner(x, pos), mlp_step(x, pos))  # 2 rows sliced from the 8-row graph
    assert rows_run == [8]  # the graph ran, not eager
    stats = runner.stats()
    assert (stats["replays"], stats["covered"], stats["fallbacks"]) == (1, 1, {})
    (entry,) = runner._cache.entries()
    static_x = entry.static_args[0]
    assert torch.equal(static_x[:2], x)
    assert bool((static_x[2:] == -3.0).all())  # every row past the real ones is padding


def test_the_covered_key_still_earns_its_own_graph(make_covering):
    runner = make_covering()
    x, pos = inputs(2, seed=1)
    runner(x, pos)
    assert runner.capture_in_flight is not None and runner.capture_in_flight.rows == 2
    drain(runner)
    assert sorted(key.rows for key in runner.admitted_keys()) == [2, 8]
    assert_same(runner(x, pos), mlp_step(x, pos))
    stats = runner.stats()
    assert (stats["replays"], stats["covered"]) == (2, 1)  # the second call hit its own key


def test_a_call_deferred_by_another_capture_in_flight_is_covered(make_covering):
    runner = make_covering()
    runner(*inputs(2))  # starts capturing the 2-row key
    x, pos = inputs(4, seed=2)
    assert_same(runner(x, pos), mlp_step(x, pos))  # deferred: one capture at a time
    stats = runner.stats()
    assert (stats["covered"], stats["fallbacks"]) == (2, {})


def test_no_cover_beyond_max_pad_factor(make_covering):
    runner = make_covering(factor=2)  # 2 rows may pad to 4, not to 8
    x, pos = inputs(2, seed=1)
    assert_same(runner(x, pos), mlp_step(x, pos))
    stats = runner.stats()
    assert (stats["covered"], stats["fallbacks"]) == (0, {"capture_in_progress": 1})


def test_the_default_never_covers(make_runner, backend):
    runner = make_runner(
        mlp_step, backend=backend, buckets=BUCKETS, admission=EAGER_FIRST, background=True
    )
    runner.warmup([inputs(8)], progress=False)
    runner(*inputs(2))
    stats = runner.stats()
    assert (stats["covered"], stats["fallbacks"]) == (0, {"capture_in_progress": 1})
    with pytest.raises(ValueError, match="max_pad_factor"):
        gg.GraphRunner(
            mlp_step, buckets=BUCKETS, backend="sim", capture=gg.CaptureConfig(max_pad_factor=0)
        )


def test_a_quarantined_key_runs_eagerly_not_through_a_cover(make_covering):
    def step(x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] == 2:
            x = x * float(x.sum())  # a host sync: no capture of 2 rows can hold it
        return mlp_step(x, pos)

    runner = make_covering(fn=step, background=False)
    x, pos = inputs(2, seed=1)
    runner(x, pos)  # its capture fails: the key is quarantined
    assert runner.stats()["capture_failures"] == 1
    assert_same(runner(x, pos), step(x, pos))
    stats = runner.stats()
    assert stats["covered"] == 0
    assert stats["fallbacks"][FallbackReason.QUARANTINED.value] == 1


def test_followers_replay_the_leaders_cover(make_covering):
    leader, follower = make_covering(background=False), make_covering(background=False)
    leader.policy.config = follower.policy.config = gg.AdmissionConfig(min_hits=3)
    x, pos = inputs(2, seed=1)
    decision = leader.decide((x, pos))
    assert decision.action is Action.REPLAY and decision.cover is not None
    assert decision.cover.rows == 8 and decision.key.rows == 2
    for runner in (leader, follower):
        assert_same(runner.follow((x, pos), decision), mlp_step(x, pos))
        assert runner.stats()["covered"] == 1


@pytest.mark.parametrize("factor", [2, 4, 16])
def test_a_pad_ladder_answers_every_bucket_with_no_spare_rung(factor):
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    ladder = pad_ladder(sizes, factor)
    assert ladder == sorted(ladder, reverse=True) and set(ladder) <= set(sizes)

    def answered(rungs: list[int]) -> bool:
        return all(any(size <= rung <= size * factor for rung in rungs) for size in sizes)

    assert answered(ladder)
    assert not any(answered([r for r in ladder if r != rung]) for rung in ladder)


def test_the_ladders_of_the_engines_defaults():
    assert pad_ladder([1, 2, 4, 8, 16, 32], 16) == [32, 1]  # decode batches, max_num_seqs 32
    assert pad_ladder([16 << i for i in range(8)], 4) == [2048, 256, 32]  # prefills as rows
    assert pad_ladder([1, 2, 4, 8], 1) == [1]  # no pad-up: the smallest key prices alone


def test_with_its_ladder_captured_every_bucket_replays_from_the_first_call(make_runner, backend):
    runner = make_runner(
        mlp_step,
        backend=backend,
        buckets=BUCKETS,
        max_pad_factor=2,
        admission=EAGER_FIRST,
        background=True,
    )
    ladder = pad_ladder(BUCKETS.batch, 2)
    assert ladder == [16, 4]
    runner.warmup([inputs(rows) for rows in ladder], progress=False)
    for rows in (1, 2, 3, 4, 6, 8, 12, 16):
        x, pos = inputs(rows, seed=rows)
        assert_same(runner(x, pos), mlp_step(x, pos))
    stats = runner.stats()
    # 1 to 2 rows rode the 4-row graph, 6 to 8 the 16-row one, while their keys waited
    assert (stats["replays"], stats["covered"], stats["fallbacks"]) == (8, 4, {})
