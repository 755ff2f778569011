"""Choices of one request (n > 1) share one prefill: forks wait on their parent, start from its
prompt KV (full blocks shared by reference, the partly filled last block copied) and give every
block back exactly once, whichever way each of them ends. On a real KV pool, without a model."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.scheduling.scheduler import Scheduler
from graphguard.engine.scheduling.sequence import Sequence, SequenceStatus
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.engine.tokens.structured import InvalidParamError

BLOCK_SIZE = 4


def _scheduler(num_usable_blocks: int = 16, max_num_seqs: int = 8) -> Scheduler:
    kv = PagedKVStorage(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        num_blocks=num_usable_blocks + 1,
        block_size=BLOCK_SIZE,
        dtype=torch.float32,
        device="cpu",
    )
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)


def _group(scheduler: Scheduler, num_prompt_tokens: int, n: int) -> list[Sequence]:
    prompt = list(range(1, num_prompt_tokens + 1))
    parent = Sequence("c-0", prompt, SamplingParams())
    scheduler.add(parent)
    forks = [Sequence(f"c-{j}", prompt, SamplingParams()) for j in range(1, n)]
    for fork in forks:
        scheduler.add_fork(parent, fork)
    return [parent, *forks]


def _step(scheduler: Scheduler) -> list[Sequence]:
    """One step as the engine runs it: schedule, start forks, append a token to each row."""
    batch = scheduler.schedule()
    forks = scheduler.advance(batch)
    sampled = [s for s, done in zip(batch.seqs, batch.completes, strict=True) if done]
    for seq in [*sampled, *(fork for _, fork in forks)]:
        seq.append_token(7)
    return batch.seqs


def _kv(scheduler: Scheduler) -> PagedKVStorage:
    assert isinstance(scheduler.kv, PagedKVStorage)
    return scheduler.kv


def test_forks_are_not_prefilled_and_sample_from_their_parents_row() -> None:
    scheduler = _scheduler()
    parent, *forks = _group(scheduler, num_prompt_tokens=10, n=3)
    batch = scheduler.schedule()
    assert batch.seqs == [parent]
    started = scheduler.advance(batch)
    assert started == [(0, forks[0]), (0, forks[1])]
    assert scheduler.num_prefilled_tokens == 10
    assert all(f.status is SequenceStatus.RUNNING and f.num_cached_tokens == 10 for f in forks)


def test_forks_share_the_full_blocks_and_copy_the_partly_filled_last_one() -> None:
    scheduler = _scheduler()
    parent, *forks = _group(scheduler, num_prompt_tokens=10, n=3)
    batch = scheduler.schedule()
    kv = _kv(scheduler)
    last = parent.block_table[2]
    for cache in (*kv.k_cache, *kv.v_cache):
        cache[last].fill_(3.0)  # the prefill's K/V of prompt tokens 8 and 9
    scheduler.advance(batch)
    full = parent.block_table[:2]
    for fork in forks:
        assert fork.block_table[:2] == full
        assert fork.block_table[2] not in (
            last,
            *(f.block_table[2] for f in forks if f is not fork),
        )
        assert all(bool((c[fork.block_table[2]] == 3.0).all()) for c in kv.k_cache + kv.v_cache)
    assert [kv.num_holders(b) for b in full] == [3, 3]


def test_a_prompt_of_whole_blocks_needs_no_copy() -> None:
    scheduler = _scheduler()
    parent, *forks = _group(scheduler, num_prompt_tokens=8, n=3)
    scheduler.schedule()
    assert _kv(scheduler).num_used_blocks == 2  # nothing reserved for copies
    _step(scheduler)
    assert all(f.block_table == parent.block_table[:2] for f in forks)


def test_admission_waits_for_room_for_the_whole_group() -> None:
    scheduler = _scheduler(max_num_seqs=4)
    scheduler.add(Sequence("other", [1, 2], SamplingParams()))
    _step(scheduler)
    parent, *_ = _group(scheduler, num_prompt_tokens=5, n=4)
    assert scheduler.schedule().prefills == []  # 1 running + 4 choices > 4 slots
    scheduler.abort("other")
    assert scheduler.schedule().prefill_seqs == [parent]


def test_a_group_that_can_never_run_together_is_refused_naming_n() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    with pytest.raises(InvalidParamError, match="max_num_seqs") as refused:
        _group(scheduler, num_prompt_tokens=5, n=3)
    assert refused.value.param == "n"


def test_every_block_returns_once_parent_and_forks_finish_in_any_order() -> None:
    scheduler = _scheduler()
    group = _group(scheduler, num_prompt_tokens=10, n=3)
    for _ in range(4):
        _step(scheduler)
    for seq in (group[1], group[0], group[2]):
        assert _kv(scheduler).num_used_blocks > 0
        scheduler.finish(seq, "stop")
    assert _kv(scheduler).num_used_blocks == 0


def test_aborting_a_fork_before_it_starts_frees_its_reserved_block() -> None:
    scheduler = _scheduler()
    parent, fork = _group(scheduler, num_prompt_tokens=10, n=2)
    scheduler.schedule()
    assert _kv(scheduler).num_used_blocks == 4  # 3 for the prompt, 1 reserved
    assert scheduler.abort(fork.request_id) is fork
    assert _kv(scheduler).num_used_blocks == 3 and parent.forks == []


def test_aborting_the_parent_before_its_prefill_hands_the_prompt_to_its_first_fork() -> None:
    scheduler = _scheduler()
    parent, heir, other = _group(scheduler, num_prompt_tokens=10, n=3)
    scheduler.schedule()  # admitted; the prefill has not run
    scheduler.abort(parent.request_id)
    assert _kv(scheduler).num_used_blocks == 0
    assert list(scheduler.waiting) == [heir] and heir.forks == [other]
    _step(scheduler)
    assert scheduler.running == [heir, other]


def test_a_preempted_parent_gives_back_its_forks_reservations_and_keeps_its_forks() -> None:
    scheduler = _scheduler()
    parent, fork = _group(scheduler, num_prompt_tokens=10, n=2)
    scheduler.schedule()
    scheduler._preempt(parent)
    assert _kv(scheduler).num_used_blocks == 0
    assert parent.forks == [fork] and fork.block_table == []
    _step(scheduler)
    assert scheduler.running == [parent, fork]


def test_abort_all_reaches_forks_that_have_not_started() -> None:
    scheduler = _scheduler()
    group = _group(scheduler, num_prompt_tokens=10, n=3)
    scheduler.schedule()
    assert {s.request_id for s in scheduler.abort_all()} == {s.request_id for s in group}
    assert _kv(scheduler).num_used_blocks == 0 and not (scheduler.waiting or scheduler.running)
