"""SegmentedRunner on SimBackend: segments, groups as a unit, budget, failures, kill switch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import graphguard.core.entry as entry_module
from graphguard.core.admission import AdmissionConfig
from graphguard.core.keys import GraphKey
from graphguard.core.reasons import FallbackReason
from graphguard.core.sim import SimBackend
from graphguard.segmented import Segment, SegmentedRunner, Stage, run_eager, split_segments
from graphguard.segmented.group import SegmentGroup, capture_group
from tests.runner_options import grouped
from tests.unit.core.conftest import PerfCounter

EAGER_FIRST = AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)
W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


@dataclass(frozen=True)
class Ctx:
    scale: float = 1.0


def hole(ctx: Ctx, x: torch.Tensor) -> tuple[torch.Tensor]:
    # Host syncs and host-side context: this could never be captured.
    return (x * float(x.abs().max()) * ctx.scale,)


STAGES = [
    Stage("proj", lambda x: (torch.tanh(x @ W),)),
    Stage("act", lambda x: (torch.relu(x * 1.5),)),
    Stage("hole0", hole, eager=True),
    Stage("mix", lambda x: (x @ W.T,)),
    Stage("hole1", hole, eager=True),
    Stage("out", lambda x: (x.sin(), x.cos().sum(-1))),
]


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


@pytest.fixture
def made():
    runners: list[SegmentedRunner] = []
    yield runners
    for runner in runners:
        runner.close()


@pytest.fixture
def make(made):
    def build(stages=STAGES, **kwargs) -> SegmentedRunner:
        kwargs.setdefault("backend", SimBackend())
        kwargs.setdefault("admission", EAGER_FIRST)
        runner = SegmentedRunner(stages, **grouped(kwargs))
        made.append(runner)
        return runner

    return build


def x_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))


def assert_bitwise(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for got, want in zip(a, b, strict=True):
        assert torch.equal(got, want)


def test_consecutive_capturable_stages_form_one_segment():
    pieces = split_segments(STAGES)
    kinds = [p.name if isinstance(p, Segment) else f"eager:{p.name}" for p in pieces]
    assert kinds == ["proj+act", "eager:hole0", "mix", "eager:hole1", "out"]


def test_a_pipeline_without_capturable_stages_is_refused():
    with pytest.raises(ValueError, match="capturable"):
        split_segments([Stage("hole", hole, eager=True)])


def test_replays_match_the_eager_pipeline_bitwise_on_new_inputs(make):
    runner = make()
    for seed in range(4):
        x = x_of(5, seed)
        assert_bitwise(runner((x,), Ctx()), runner.eager((x,), Ctx()))
    stats = runner.stats()
    assert stats["captures"] == 1 and stats["replays"] == 4 and stats["fallbacks"] == {}


def test_eager_stages_see_each_calls_context_between_replays(make):
    runner = make()
    runner((x_of(5),), Ctx(1.0))
    got = runner((x_of(5, 1),), Ctx(3.0))
    assert runner.stats()["replays"] == 2
    assert_bitwise(got, runner.eager((x_of(5, 1),), Ctx(3.0)))


def test_one_key_owns_one_group_with_its_own_pool_and_stream(make):
    runner = make()
    runner((x_of(5),), Ctx())
    runner((x_of(6),), Ctx())
    groups = runner.groups()
    assert [len(g.entries) for g in groups] == [3, 3]
    for group in groups:
        assert {id(e.pool) for e in group.entries} == {id(group.pool)}
        assert {e.stream for e in group.entries} == {group.stream}
    assert groups[0].pool != groups[1].pool and groups[0].stream != groups[1].stream


def test_a_group_is_charged_the_sum_of_its_segments(make):
    runner = make()
    runner((x_of(5),), Ctx())
    (group,) = runner.groups()
    assert group.resident_bytes == sum(e.resident_bytes for e in group.entries)
    # the segments share one pool: the group is charged that pool, counted once
    assert runner.stats()["resident_bytes"] == group.resident_bytes
    assert group.resident_bytes == runner.backend.pool_reserved_bytes(group.pool) > 0


def test_eviction_retires_all_three_segments_their_pool_and_stream(make):
    backend = SimBackend()
    probe = make(backend=SimBackend())
    probe((x_of(5),), Ctx())
    one_group = probe.stats()["resident_bytes"]
    runner = make(backend=backend, max_bytes=2 * one_group - 1)  # room for one group
    runner((x_of(5),), Ctx())
    (first,) = runner.groups()
    pool, stream, entries = first.pool, first.stream, list(first.entries)
    runner((x_of(6),), Ctx())
    assert runner.stats()["evictions"] == 1 and first.is_retired
    assert all(e.is_retired and e.graph is None and e.static_args == [] for e in entries)
    assert backend.pool_reserved_bytes(pool) == 0 and stream in backend.released_streams
    assert first.pool_group.num_members == 0


def test_a_1mib_budget_serves_every_call_eagerly_and_correctly(make):
    runner = make(max_bytes=1 << 20)
    for seed in range(3):
        x = x_of(5, seed)
        assert_bitwise(runner((x,), Ctx()), runner.eager((x,), Ctx()))
    stats = runner.stats()
    assert stats["groups"] == 0 and stats["resident_bytes"] == 0
    assert stats["fallbacks"] == {"over_budget": 3}
    assert runner.backend.num_captures == 1  # the size hint stops later attempts


def test_capture_failure_in_a_later_segment_retires_the_partial_group(make):
    def sync(x):
        return (x.nonzero().float().sum() + x,)  # a host sync inside a capturable stage

    stages = [*STAGES[:4], Stage("bad", sync)]
    backend = SimBackend()
    runner = make(stages, backend=backend)
    x = x_of(5)
    assert_bitwise(runner((x,), Ctx()), runner.eager((x,), Ctx()))
    stats = runner.stats()
    assert stats["fallbacks"] == {"capture_failed": 1} and stats["quarantined_keys"] == 1
    assert stats["groups"] == 0 and sum(backend._pool_bytes.values()) == 0


def test_parity_mismatch_rejects_the_group_and_quarantines_the_key(make):
    calls = [0]

    def drifting(x):
        calls[0] += 1  # host state baked into the graph: the eager reference disagrees
        return (x + calls[0],)

    runner = make([STAGES[0], STAGES[2], Stage("drift", drifting)])
    x = x_of(5)
    out = runner((x,), Ctx())
    stats = runner.stats()
    assert stats["fallbacks"] == {"parity_mismatch": 1} and stats["parity_mismatches"] == 1
    assert stats["groups"] == 0 and stats["quarantined_keys"] == 1
    assert out[0].shape == x.shape
    assert runner((x,), Ctx()) is not None
    assert runner.stats()["fallbacks"]["quarantined"] == 1


def test_kill_switch_runs_every_call_eagerly(make, monkeypatch):
    runner = make()
    runner((x_of(5),), Ctx())
    monkeypatch.setenv("GRAPHGUARD_DISABLE", "1")
    x = x_of(5, 2)
    assert_bitwise(runner((x,), Ctx()), runner.eager((x,), Ctx()))
    assert runner.stats()["fallbacks"] == {"kill_switch": 1}


def test_a_key_is_captured_only_after_it_earned_it(make):
    runner = make(admission=AdmissionConfig(min_hits=2))
    runner((x_of(5),), Ctx())
    assert runner.stats()["fallbacks"] == {"admission_deferred": 1}
    runner((x_of(5),), Ctx())
    assert runner.stats()["groups"] == 1


def test_close_retires_every_group_and_later_calls_run_eagerly(make):
    runner = make()
    runner((x_of(5),), Ctx())
    (group,) = runner.groups()
    runner.close()
    assert group.is_retired and runner.stats()["groups"] == 0
    runner((x_of(5),), Ctx())
    assert runner.stats()["fallbacks"] == {"closed": 1}


def test_an_eager_stage_that_changes_shape_finishes_the_call_eagerly(make):
    def grow(copies, x):
        return (torch.cat([x] * copies),)

    runner = make([STAGES[0], Stage("grow", grow, eager=True), STAGES[3]])
    runner((x_of(5),), 1)
    x = x_of(5, 1)
    assert_bitwise(runner((x,), 2), runner.eager((x,), 2))
    assert runner.stats()["fallbacks"] == {FallbackReason.UNBUCKETED_SHAPE.value: 1}


def test_results_are_copies_even_behind_a_pass_through_eager_tail(make):
    stages = [Stage("double", lambda x: (x * 2,)), Stage("tail", lambda ctx, x: (x,), eager=True)]
    runner = make(stages)
    first = runner([torch.ones(4)])[0]
    runner([torch.full((4,), 5.0)])
    runner([torch.full((4,), 5.0)])
    assert torch.equal(first, torch.full((4,), 2.0))


def test_an_eager_stage_raising_mid_capture_releases_the_partial_group(make):
    def failing(ctx, x):
        raise RuntimeError("eager stage failed")

    backend = SimBackend()
    runner = make(
        [
            Stage("a", lambda x: (x + 1,)),
            Stage("hole", failing, eager=True),
            Stage("b", lambda x: (x * 2,)),
        ],
        backend=backend,
    )
    with pytest.raises(RuntimeError, match="eager stage failed"):
        runner([torch.ones(2)], Ctx())
    assert backend._pool_bytes == {} and runner.stats()["groups"] == 0


def test_group_infos_describe_each_admitted_group_and_its_segments(make, monkeypatch):
    monkeypatch.setattr(entry_module, "time", PerfCounter(step_s=0.0001234))
    runner = make()
    runner((x_of(5),), Ctx())
    runner((x_of(5),), Ctx())
    (group,) = runner.groups()
    (info,) = runner.group_infos()
    assert (info.key, info.state, info.verified) == (group.key.describe(), "admitted", "exact")
    assert info.resident_bytes == group.resident_bytes > 0
    assert info.replays == 2
    assert info.capture_ms == 0.37  # three segments of 0.1234 ms each
    assert [s.key for s in info.segments] == [e.key.describe() for e in group.entries]
    assert {(s.state, s.verified) for s in info.segments} == {("admitted", "exact")}


def test_retiring_a_group_twice_reports_false_the_second_time():
    group = SegmentGroup(GraphKey(("k",)), SimBackend(), "segmented")
    assert group.retire() is True
    assert group.retire() is False


def test_every_segment_graph_retains_the_runners_owners(make):
    weights = torch.ones(8)  # stands for what the graphs read
    runner = make(retain=[weights])
    runner((x_of(5),), Ctx())
    (group,) = runner.groups()
    assert all(len(e.owners) == 1 and e.owners[0] is weights for e in group.entries)


def test_a_group_exactly_the_size_of_the_budget_is_admitted(make):
    probe = make()
    probe((x_of(5),), Ctx())
    runner = make(max_bytes=probe.stats()["resident_bytes"])
    runner((x_of(5),), Ctx())
    assert runner.stats()["groups"] == 1 and runner.stats()["fallbacks"] == {}


def test_the_eager_tail_after_a_shape_change_sees_the_calls_context(make):
    def grow(copies, x):
        return (torch.cat([x] * copies),)

    def scale(copies, x):
        return (x * copies,)

    stages = [
        STAGES[0],
        Stage("grow", grow, eager=True),
        STAGES[3],
        Stage("scale", scale, eager=True),
    ]
    runner = make(stages)
    runner((x_of(5),), 1)
    x = x_of(5, 1)
    assert_bitwise(runner((x,), 2), runner.eager((x,), 2))


def test_a_new_group_is_pending_and_its_pool_is_named_for_its_runner_and_key():
    key = GraphKey(("k",))
    group = SegmentGroup(key, SimBackend(), "prefill")
    info = group.info()
    assert (info.state, info.verified, info.resident_bytes) == ("new", "pending", 0)
    assert group.pool_group.name == f"prefill:{key.describe()}"


def test_each_owner_is_searched_for_a_cycle_once_per_group(make, monkeypatch):
    searched: list[object] = []
    real = entry_module.refers_to

    def counting(root, targets):
        searched.append(root)
        return real(root, targets)

    monkeypatch.setattr(entry_module, "refers_to", counting)
    weights = torch.ones(8)
    runner = make(retain=[weights], backend=SimBackend(num_warmup=1))
    runner((x_of(5),), Ctx())
    (group,) = runner.groups()
    assert len(group.entries) == 3 and searched == [weights]  # not once per segment


def test_an_owner_that_reaches_the_group_is_refused_naming_the_key(make):
    class Box:
        group: object = None

    box = Box()
    runner = make(retain=[box], strict=True)
    real_new = runner.kind.new_candidate

    def new_candidate(key):
        box.group = real_new(key)  # the owner now refers to the group being captured
        return box.group

    runner.kind.new_candidate = new_candidate  # type: ignore[method-assign]
    with pytest.raises(entry_module.OwnerCycleError, match="refers back to graph"):
        runner((x_of(5),), Ctx())
    assert runner.stats()["groups"] == 0


def test_segment_warm_ups_run_each_segments_own_function(make):
    backend = SimBackend(num_warmup=2)
    runner = make(backend=backend)
    out = runner((x_of(5),), Ctx())
    assert backend.num_warmups == 2 * 3  # two per segment
    assert torch.equal(out[0], runner.eager((x_of(5),), Ctx())[0])
    assert runner.stats()["captures"] == 1


def passing(ctx: Ctx, x: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An eager stage that computes one carry tensor and passes the other through."""
    return hole(ctx, x)[0], kept


PASS_THROUGH = [
    Stage("split", lambda x: (torch.tanh(x @ W), x.cos())),
    Stage("hole", passing, eager=True),
    Stage("join", lambda x, kept: (x @ W.T + kept,)),
]


def test_what_an_eager_stage_passes_through_is_read_where_the_segment_before_wrote_it(make):
    runner = make(PASS_THROUGH)
    runner((x_of(4),), Ctx())  # captured on this call
    (group,) = runner.groups()
    first, second = group.entries
    assert second.static_args[1] is first.static_outputs[1]  # no buffer, no copy a call
    assert second.static_args[0] is not first.static_outputs[0]  # the eager stage's new tensor
    for seed in range(1, 4):
        assert_bitwise(runner((x_of(4, seed),), Ctx()), runner.eager((x_of(4, seed),), Ctx()))
    assert group.replays == 4


@dataclass(frozen=True)
class Skip:
    skip: bool


def skip_or_scale(ctx: Skip, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Passes h on, or 3 h, and keeps h as the residual: h twice in the carry when it skips."""
    return (h if ctx.skip else h * 3.0), h


def test_a_call_whose_eager_stage_does_not_pass_through_what_the_capture_did_runs_eagerly(make):
    runner = make([
        Stage("a", lambda x: (torch.tanh(x @ W),)),
        Stage("maybe", skip_or_scale, eager=True),
        Stage("b", lambda h, residual: (h @ W.T + residual,)),
    ])  # fmt: skip
    runner((x_of(4),), Skip(True))  # captured where h is passed through at both positions
    for seed in (1, 2):
        x = x_of(4, seed)
        assert_bitwise(runner((x,), Skip(False)), runner.eager((x,), Skip(False)))
    assert runner.stats()["fallbacks"] == {FallbackReason.UNBUCKETED_SHAPE.value: 2}
    assert_bitwise(runner((x_of(4, 3),), Skip(True)), runner.eager((x_of(4, 3),), Skip(True)))


def test_a_segments_replay_and_the_eager_stage_after_it_are_one_capture_unit():
    """A stage after a segment reads what the segment's graph wrote outside the carry (the
    engine's K/V); steps run between a capture's units may write the same place (the dummy
    block). Here each unit is followed by such a write: the captured path still equals eager."""
    state = torch.zeros(4, 8)

    def write(x: torch.Tensor) -> tuple[torch.Tensor]:
        state.copy_(torch.tanh(x @ W))  # a side effect, as the K/V write
        return (x,)

    def read(ctx: Ctx, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + state,)

    pieces = split_segments([Stage("w", write), Stage("r", read, eager=True),
                             Stage("out", lambda x: (x.sin(),))])  # fmt: skip
    group = SegmentGroup(GraphKey(("k",)), SimBackend(num_warmup=2), "segmented")
    units = capture_group(group, pieces, (x_of(4),), Ctx(), (), 1 << 30)
    try:
        while True:
            next(units)
            state.fill_(100.0)  # a step between units writes the shared place
    except StopIteration as done:
        graphed = done.value
    assert_bitwise(graphed, run_eager(pieces, (x_of(4),), Ctx()))
    group.retire()


def test_a_fallback_answers_the_calls_without_a_graph_and_is_timed_for_payback(make):
    """`fallback`: a call that replays no group is answered by it (here a slower way to the
    same carry), not by the pipeline run eagerly; the admission times it as the eager call it
    stands for (the payback rule's excess), and the parity check still runs the pipeline."""
    calls = []

    def fallback(call):
        calls.append(call)
        return run_eager(split_segments(STAGES), *call)

    payback = AdmissionConfig(min_hits=3, frequency_aware=False, max_capture_fraction=1.0,
                              payback=1.0)  # fmt: skip
    runner = make(admission=payback, fallback=fallback)
    x = x_of(4)
    for _ in range(2):  # not yet earned: the fallback answers
        assert_bitwise(runner((x,), Ctx()), run_eager(runner.pieces, (x,), Ctx()))
    assert len(calls) == 2 and runner.stats()["replays"] == 0
    (key,) = runner.policy._excess  # both fallbacks were timed for the key
    assert runner.policy._excess[key] > 0
    for _ in range(3):
        runner((x,), Ctx())
    assert runner.stats()["replays"] >= 1 and runner.stats()["parity_mismatches"] == 0
