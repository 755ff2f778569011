"""How tensor-parallel ranks talk: rank 0 broadcasts each step's work and every graph decision
on a CPU (gloo) group, and the ranks agree on each unit of capture work there too.

The model's own collectives (all-reduce, all-gather) run on the device group: NCCL on CUDA,
gloo on CPU. Messages, decisions and votes run on a second, gloo group whatever the device,
so a step's control never waits behind device work. Every group has the configured timeout:
a rank that stops answering becomes a RanksLost error on the others, never a silent hang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch.distributed as dist

from graphguard.core.decisions import Decision
from graphguard.engine.parallel.agreement import (
    Agreement,
    FollowerOrders,
    LeaderOrders,
    Orders,
    Vote,
    worst_vote,
)
from graphguard.engine.scheduling.batch import PrefillChunk, ScheduledBatch
from graphguard.engine.scheduling.sequence import Sequence
from graphguard.engine.tokens.sampling import SamplingParams

log = logging.getLogger("graphguard")


class RanksLost(RuntimeError):
    """A rank stopped answering (it crashed, or a collective timed out): serving ends."""


@dataclass(frozen=True)
class RankRole:
    """What a rank's graph runners are given: where decisions come from, how outcomes agree."""

    orders: Orders
    agreement: Agreement


class Channel:
    """Rank 0 -> every rank, in order, on the control group (broadcast_object_list)."""

    def __init__(self, group: Any, is_alive: Any = None) -> None:
        self.group = group
        self._is_alive = is_alive  # rank 0: raises RanksLost when a follower has exited

    def send(self, message: Any) -> None:
        if self._is_alive is not None:
            self._is_alive()
        self._broadcast([message])

    def receive(self) -> Any:
        box: list[Any] = [None]
        self._broadcast(box)
        return box[0]

    def _broadcast(self, box: list[Any]) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as exc:
            raise RanksLost(f"tensor-parallel ranks lost: {exc}") from exc


class GroupAgreement:
    """Every rank's vote gathered on the control group; every rank takes the worst."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group
        self.world_size = world_size

    def agree(self, vote: Vote) -> Vote:
        votes: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(votes, vote, group=self.group)
        except RuntimeError as exc:
            raise RanksLost(f"tensor-parallel ranks lost agreeing on a capture: {exc}") from exc
        return worst_vote(votes)


class SeqState(NamedTuple):
    """What the model runner reads of a sequence, sent to the followers with each batch."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int
    params: SamplingParams
    num_scored: int  # prompt tokens with a logprob so far (None: not asked)

    @classmethod
    def of(cls, seq: Sequence) -> SeqState:
        scored = -1 if seq.prompt_logprobs is None else len(seq.prompt_logprobs)
        return cls(
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.block_table,
            seq.num_cached_tokens,
            seq.params,
            scored,
        )

    def rebuild(self) -> Sequence:
        seq = Sequence("follower", self.prompt_token_ids, self.params)
        seq.output_token_ids = list(self.output_token_ids)
        seq.block_table = list(self.block_table)
        seq.num_cached_tokens = self.num_cached_tokens
        seq.prompt_logprobs = None if self.num_scored < 0 else [None] * self.num_scored
        return seq


@dataclass(frozen=True)
class BatchMessage:
    """One step's batch, as the followers' model runners need it."""

    decodes: list[SeqState]
    prefills: list[tuple[SeqState, int, bool]]  # (sequence, chunk tokens, completes)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> BatchMessage:
        prefills = [(SeqState.of(c.seq), c.num_tokens, c.completes) for c in batch.prefills]
        return cls([SeqState.of(seq) for seq in batch.decodes], prefills)

    def rebuild(self) -> ScheduledBatch:
        prefills = [PrefillChunk(s.rebuild(), n, done) for s, n, done in self.prefills]
        return ScheduledBatch([s.rebuild() for s in self.decodes], prefills)


@dataclass(frozen=True)
class Shutdown:
    """The leader is shutting down: followers release their graphs and exit."""


class LeaderLink:
    """Rank 0's side: the graph runners' role, and the step's work sent before it runs."""

    def __init__(self, channel: Channel, agreement: Agreement) -> None:
        self.channel = channel
        self.role = RankRole(LeaderOrders(channel.send), agreement)
        self.follower_reports: list[Any] = []  # each follower's graph stats, at shutdown

    def send_batch(self, batch: ScheduledBatch) -> None:
        self.channel.send(BatchMessage.of(batch))

    def send_shutdown(self) -> None:
        try:
            self.channel.send(Shutdown())
            self.follower_reports = gather_reports(self.channel.group, None)[1:]
        except RanksLost as exc:  # NOTE: shutting down anyway; say why the followers missed it
            log.warning("graphguard shutdown not delivered to every rank: %s", exc)


def follower_role(channel: Channel, agreement: Agreement) -> RankRole:
    def receive() -> Decision:
        message = channel.receive()
        if not isinstance(message, Decision):
            raise RanksLost(f"expected the leader's graph decision, got {type(message).__name__}")
        return message

    return RankRole(FollowerOrders(receive), agreement)


def gather_reports(group: Any, report: Any) -> list[Any]:
    """Every rank's report on rank 0 (others get an empty list): at shutdown, what each
    follower's graphs did, for logs and tests."""
    is_leader = dist.get_rank(group) == 0
    reports: list[Any] | None = [None] * dist.get_world_size(group) if is_leader else None
    try:
        dist.gather_object(report, reports, dst=0, group=group)
    except RuntimeError as exc:
        raise RanksLost(f"tensor-parallel ranks lost at shutdown: {exc}") from exc
    return reports or []
