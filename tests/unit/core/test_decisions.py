"""One decision, every rank: a leader's runner decides, followers carry its decisions out
(Runner.decide / Runner.follow; the ranks' votes: graphguard/engine/parallel/agreement.py).
Two runners in one process stand for two ranks."""

from __future__ import annotations

import pytest
import torch

import graphguard as gg
from graphguard.core.decisions import Action, DecisionError
from graphguard.core.reasons import CaptureOutcome, FallbackReason
from graphguard.engine.parallel.agreement import RankDivergence, Vote, worst_vote

BUCKETS = gg.Buckets(batch=(2, 4))


def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)), torch.ones(rows, 8)


def lead(leader, follower, args):
    decision = leader.decide(args)
    return decision, leader.follow(args, decision), follower.follow(args, decision)


@pytest.fixture
def pair(make_runner):
    return make_runner(buckets=BUCKETS), make_runner(buckets=BUCKETS)


def test_the_worst_vote_wins_and_the_largest_bytes_are_charged():
    votes = [Vote(None, 10, False), Vote(CaptureOutcome.OVER_BUDGET, 30, True)]
    votes.append(Vote(CaptureOutcome.FAILED, 20, True))
    assert worst_vote(votes) == Vote(CaptureOutcome.FAILED, 30, True)
    assert worst_vote([Vote(None, 5, False), Vote(None, 9, False)]) == Vote(None, 9, False)


def test_a_state_refusal_on_any_rank_is_every_ranks_with_its_reason():
    refused = Vote(CaptureOutcome.STATE_REFUSED, 10, True, FallbackReason.PYTHON_STATE)
    votes = [Vote(CaptureOutcome.FAILED, 20, True), refused, Vote(None, 5, True)]
    assert worst_vote(votes) == Vote(
        CaptureOutcome.STATE_REFUSED, 20, True, FallbackReason.PYTHON_STATE
    )


def test_ranks_that_disagree_on_whether_a_capture_ended_diverge():
    with pytest.raises(RankDivergence):
        worst_vote([Vote(None, 1, True), Vote(None, 1, False)])


def test_a_follower_captures_and_replays_exactly_when_its_leader_does(pair):
    leader, follower = pair
    actions = [lead(leader, follower, inputs(2))[0].action for _ in range(3)]
    assert actions == [Action.CAPTURE, Action.REPLAY, Action.REPLAY]
    assert follower.admitted_keys() == leader.admitted_keys()
    assert follower.stats()["replays"] == leader.stats()["replays"] == 3


def test_a_follower_evicts_what_its_leader_no_longer_holds(pair):
    leader, follower = pair
    lead(leader, follower, inputs(2))
    leader.invalidate()  # the leader alone drops its graph
    lead(leader, follower, inputs(4))
    assert follower.admitted_keys() == leader.admitted_keys()
    assert [key.rows for key in follower.admitted_keys()] == [4]


def test_a_follower_told_to_replay_a_key_it_does_not_hold_diverges(pair, make_runner):
    leader, _ = pair
    lead(leader, make_runner(buckets=BUCKETS), inputs(2))
    stranger = make_runner(buckets=BUCKETS)
    with pytest.raises(DecisionError):
        stranger.follow(inputs(2), leader.decide(inputs(2)))


def test_the_leaders_kill_switch_is_the_followers_fallback(pair, monkeypatch):
    leader, follower = pair
    monkeypatch.setenv(gg.KILL_SWITCH_ENV, "1")
    decision = leader.decide(inputs(2))
    monkeypatch.delenv(gg.KILL_SWITCH_ENV)  # the follower's environment says nothing
    follower.follow(inputs(2), decision)
    assert follower.stats()["fallbacks"] == {"kill_switch": 1}
