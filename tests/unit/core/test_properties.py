"""Random call sequences against the runtime's invariants."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphguard as gg
from graphguard.core.entry import EntryState
from tests.unit.core.conftest import SEG, FakeClock, inputs, mlp_step

ops = st.one_of(
    st.tuples(st.just("call"), st.integers(1, 10), st.sampled_from([3, 4, 5])),
    st.tuples(st.just("invalidate"), st.just(0), st.just(0)),
    st.tuples(st.just("tick"), st.integers(0, 120), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget_segments=st.integers(0, 5),
    min_hits=st.integers(1, 3),
    steps=st.lists(ops, min_size=1, max_size=40),
)
def test_budget_retirement_and_results_hold_for_any_call_sequence(budget_segments, min_hits, steps):
    clock = FakeClock()
    replayed = []

    class Watching(gg.SimBackend):
        def launch(self, stream, event, work):
            replayed.append(stream)
            super().launch(stream, event, work)

    runner = gg.GraphRunner(
        mlp_step,
        buckets=gg.Buckets(batch=[1, 2, 4, 8]),
        max_bytes=budget_segments * (SEG + 1024),
        backend=Watching(),
        admission=gg.AdmissionConfig(min_hits=min_hits),
        clock=clock,
    )
    retired_streams: set[int] = set()
    try:
        for op, a, b in steps:
            before = len(replayed)
            if op == "call":
                x, pos = inputs(a, width=b, seed=a * 10 + b)
                got, ref = runner(x, pos), mlp_step(x, pos)
                assert torch.allclose(got[0], ref[0]) and torch.allclose(got[1], ref[1])
            elif op == "invalidate":
                retired_streams |= {e.stream for e in runner._cache.entries()}
                runner.invalidate()
            else:
                clock.advance(a)
            stats = runner.stats()
            entries = runner._cache.entries()
            assert stats["resident_bytes"] <= stats["max_bytes"]
            assert stats["resident_bytes"] == sum(e.resident_bytes for e in entries)
            assert all(e.state is EntryState.ADMITTED for e in entries)
            # every call is one replay or one fallback, and no pool outlives its graph
            assert stats["calls"] == stats["replays"] + sum(stats["fallbacks"].values())
            assert set(runner.backend._pool_bytes) == {e.pool[1] for e in entries}
            assert not retired_streams & set(replayed[before:])  # no retired graph replays
    finally:
        runner.close()
