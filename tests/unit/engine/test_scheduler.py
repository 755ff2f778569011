"""Scheduler: admission, token budget, block accounting and preemption, on a real KV pool."""

from __future__ import annotations

import torch

from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.scheduling.scheduler import Scheduler
from graphguard.engine.scheduling.sequence import Sequence, SequenceStatus
from graphguard.engine.tokens.sampling import SamplingParams

BLOCK_SIZE = 4


def _scheduler(num_usable_blocks: int, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    kv = PagedKVStorage(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        num_blocks=num_usable_blocks + 1,  # + the reserved dummy block
        block_size=BLOCK_SIZE,
        dtype=torch.float32,
        device="cpu",
    )
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def _seq(request_id: str, num_prompt_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams())


def _run_step(scheduler: Scheduler) -> list[str]:
    """Schedule one step and append a token to every scheduled sequence, as the engine does."""
    batch = scheduler.schedule()
    for seq in batch.seqs:
        seq.append_token(7)
    return [seq.request_id for seq in batch.seqs]


def test_admits_waiting_requests_in_arrival_order() -> None:
    scheduler = _scheduler(num_usable_blocks=16)
    for name in "abc":
        scheduler.add(_seq(name, 5))
    assert [s.request_id for s in scheduler.schedule().prefill_seqs] == ["a", "b", "c"]


def test_head_of_queue_that_does_not_fit_blocks_later_requests() -> None:
    scheduler = _scheduler(num_usable_blocks=3)
    scheduler.add(_seq("small", 4))  # 1 block
    scheduler.add(_seq("big", 12))  # 3 blocks: only 2 left
    scheduler.add(_seq("tiny", 1))  # would fit, but must not overtake "big"
    assert [s.request_id for s in scheduler.schedule().prefill_seqs] == ["small"]


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = _scheduler(num_usable_blocks=16, max_num_seqs=2)
    for name in "abc":
        scheduler.add(_seq(name, 2))
    _run_step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_token_budget_caps_the_prefills_of_one_step() -> None:
    scheduler = _scheduler(num_usable_blocks=16, budget=10)
    for name in "abcd":
        scheduler.add(_seq(name, 4))
    batch = scheduler.schedule()
    # "c" gets the 2 tokens left as a first chunk; "d" waits.
    assert [s.request_id for s in batch.prefill_seqs] == ["a", "b", "c"]
    assert batch.chunks == [4, 4, 2] and batch.num_batched_tokens == 10
    assert [s.request_id for s in scheduler.waiting] == ["d"]


def _run_chunked_step(scheduler: Scheduler) -> tuple[list[str], int]:
    """One step as the engine runs it: only sequences that complete get a token."""
    batch = scheduler.schedule()
    done = [seq for seq, ends in zip(batch.seqs, batch.completes, strict=True) if ends]
    scheduler.advance(batch)
    for seq in done:
        seq.append_token(7)
    return [seq.request_id for seq in done], batch.num_batched_tokens


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode() -> None:
    scheduler = _scheduler(num_usable_blocks=16, budget=6)
    short, long = _seq("short", 2), _seq("long", 13)
    scheduler.add(short)
    assert _run_chunked_step(scheduler) == (["short"], 2)
    scheduler.add(long)
    # Each step: one decode token for "short", the rest of the budget for "long"'s prompt.
    assert _run_chunked_step(scheduler) == (["short"], 6)
    assert long.num_cached_tokens == 5 and len(long.block_table) == 4  # reserved at admission
    assert _run_chunked_step(scheduler) == (["short"], 6)
    assert long.num_cached_tokens == 10
    assert _run_chunked_step(scheduler) == (["short", "long"], 4)  # the last 3 prompt tokens
    assert long.output_token_ids == [7] and long.num_cached_tokens == 13
    assert _run_chunked_step(scheduler) == (["short", "long"], 2)  # both decode


def test_a_step_decodes_the_running_and_prefills_the_newly_admitted() -> None:
    scheduler = _scheduler(num_usable_blocks=16)
    scheduler.add(_seq("a", 3))
    _run_step(scheduler)
    scheduler.add(_seq("b", 3))
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.decodes] == ["a"]
    assert [s.request_id for s in batch.prefill_seqs] == ["b"]
    assert batch.num_batched_tokens == 1 + 3


def test_decode_takes_a_new_block_only_when_crossing_a_block_boundary() -> None:
    scheduler = _scheduler(num_usable_blocks=4)
    seq = _seq("a", 3)
    scheduler.add(seq)
    _run_step(scheduler)  # prefill of 3 tokens: 1 block; now 4 tokens, the 4th uncached
    assert len(seq.block_table) == 1
    _run_step(scheduler)  # decode at position 3: still block 0
    assert len(seq.block_table) == 1
    _run_step(scheduler)  # decode at position 4: needs a second block
    assert len(seq.block_table) == 2


def test_out_of_blocks_preempts_the_most_recently_admitted() -> None:
    scheduler = _scheduler(num_usable_blocks=2)
    first, second = _seq("first", 4), _seq("second", 4)
    scheduler.add(first)
    scheduler.add(second)
    _run_step(scheduler)  # both prefilled, one block each; both now need a second block
    assert _run_step(scheduler) == ["first"]
    assert second.status is SequenceStatus.WAITING
    assert second.block_table == [] and second.output_token_ids == [7]
    assert list(scheduler.waiting) == [second]
    assert scheduler.num_preemptions == 1


def test_preempted_sequence_is_readmitted_to_recompute_prompt_and_output() -> None:
    scheduler = _scheduler(num_usable_blocks=2)
    first, second = _seq("first", 4), _seq("second", 4)
    scheduler.add(first)
    scheduler.add(second)
    _run_step(scheduler)
    _run_step(scheduler)  # second preempted with 5 tokens
    scheduler.finish(first, "length")
    batch = scheduler.schedule()
    assert batch.prefill_seqs == [second]
    assert second.num_cached_tokens == 0 and second.num_tokens == 5
    assert len(second.block_table) == 2


def test_a_lone_sequence_without_a_free_block_preempts_itself() -> None:
    scheduler = _scheduler(num_usable_blocks=1)
    seq = _seq("a", 4)
    scheduler.add(seq)
    _run_step(scheduler)
    assert scheduler.schedule().is_empty
    assert list(scheduler.waiting) == [seq] and scheduler.kv.num_free_blocks == 1


def test_finish_returns_every_block() -> None:
    scheduler = _scheduler(num_usable_blocks=8)
    seq = _seq("a", 9)
    scheduler.add(seq)
    _run_step(scheduler)
    scheduler.finish(seq, "stop")
    assert scheduler.kv.num_free_blocks == 8 and not (scheduler.waiting or scheduler.running)


def test_abort_frees_blocks_of_a_running_request_at_once() -> None:
    scheduler = _scheduler(num_usable_blocks=8)
    scheduler.add(_seq("a", 9))
    _run_step(scheduler)
    aborted = scheduler.abort("a")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert scheduler.kv.num_free_blocks == 8


def test_abort_of_unknown_request_is_a_no_op() -> None:
    assert _scheduler(num_usable_blocks=2).abort("nope") is None


def test_a_newer_prefill_in_progress_is_preempted_before_an_older_decode() -> None:
    scheduler = _scheduler(num_usable_blocks=3, budget=5)
    old, new = _seq("old", 3), _seq("new", 8)
    scheduler.add(old)
    _run_chunked_step(scheduler)  # old prefilled: 4 tokens, 1 block
    scheduler.add(new)
    assert _run_chunked_step(scheduler) == (["old"], 5)  # new admitted: 2 blocks, 4 tokens in
    assert new.num_cached_tokens == 4 and scheduler.kv.num_free_blocks == 0
    # old's next decode needs a block: the most recently admitted, new, gives its back.
    assert _run_chunked_step(scheduler)[0] == ["old"]
    assert list(scheduler.waiting) == [new] and new.num_cached_tokens == 0
    assert scheduler.num_preemptions == 1 and len(old.block_table) == 2
