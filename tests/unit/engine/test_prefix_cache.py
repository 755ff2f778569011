"""Prefix caching (graphguard/engine/scheduling/prefix_cache.py): a request over a prefix another
request computed prefills only the rest, and answers as an engine that never saw the first."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.intake import RequestLimits, check_request
from graphguard.engine.scheduling import kv as kv_module
from graphguard.engine.scheduling import prefix_cache as prefix_cache_module
from graphguard.engine.scheduling.kv import PagedKVStorage, prefix_hashes, token_bytes
from graphguard.engine.scheduling.prefix_cache import (
    MIN_WAIT_TOKENS,
    PrefixCache,
    RecentPrompts,
    _common_blocks,
)
from graphguard.engine.scheduling.scheduler import Scheduler
from graphguard.engine.scheduling.sequence import Sequence
from graphguard.engine.tokens.sampling import SamplingParams, TokenLogprob
from tests.unit.engine.fixtures_engine import (  # noqa: F401
    make_engine,
    one_torch_thread,
    run_to_completion,
    token_ids_of,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
ROUNDING = 1e-3  # float32 log probabilities of one model over KV computed in other chunks
LONG = dict(max_model_len=2048, max_num_batched_tokens=2048, block_size=16, num_kv_blocks=320)
CHUNKED = {**LONG, "max_num_batched_tokens": 512}


def document(length: int) -> list[int]:
    return torch.randint(10, 4000, (length,), generator=torch.Generator().manual_seed(7)).tolist()


def answer(engine, request_id: str, prompt: list[int]) -> tuple[list[TokenLogprob], int]:
    """The greedy tokens of `prompt` with their log probabilities and runners-up, and how many
    prompt tokens its prefill computed."""
    before = engine.scheduler.num_prefilled_tokens
    engine.add_request(request_id, prompt, GREEDY)
    outputs = run_to_completion(engine)[request_id]
    return [lp for out in outputs for lp in out.logprobs or []], (
        engine.scheduler.num_prefilled_tokens - before
    )


def assert_same_answer(got: list[TokenLogprob], expected: list[TokenLogprob]) -> None:
    """The same greedy tokens with log probabilities within rounding (the two computed the
    prefix's KV in different chunks); they may part only after a step whose two most likely
    tokens were within rounding of each other."""
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert abs(mine.logprob - theirs.logprob) < ROUNDING
        if mine.token_id != theirs.token_id:
            assert theirs.logprob - theirs.top[1][1] < ROUNDING, "parted without a near-tie"
            return


@pytest.mark.usefixtures("one_torch_thread")
def test_a_shared_prefix_is_prefilled_once_and_the_answer_is_unchanged(embedded_model):
    # a 700-token document, prefilled in chunks of 512 tokens a step
    doc = document(700)
    first, second = doc + [101, 102, 103], doc + [201, 202, 203, 204]
    engine = make_engine(embedded_model, **CHUNKED)
    _, first_cost = answer(engine, "first", first)
    tokens, second_cost = answer(engine, "second", second)
    assert second_cost == len(second) - 43 * 16  # 43 full blocks (688 tokens) reused
    fresh = make_engine(embedded_model, **CHUNKED)
    expected, fresh_cost = answer(fresh, "second", second)
    assert fresh_cost == len(second)
    assert_same_answer(tokens, expected)
    stats = engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == 43 * 16 and stats["cached_blocks"] > 0


@pytest.mark.usefixtures("one_torch_thread")
def test_requests_sent_together_over_one_document_prefill_it_once(embedded_model):
    doc = document(600)
    prompts = {"a": doc + [101], "b": doc + [201, 202], "c": doc + [301, 302, 303]}
    engine = make_engine(embedded_model, **LONG)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    outputs = run_to_completion(engine)
    # b and c reuse the 37 full blocks (592 tokens) a wrote: only their rest is computed
    assert engine.scheduler.num_prefilled_tokens == 601 + (602 - 592) + (603 - 592)
    fresh, _ = answer(make_engine(embedded_model, **LONG), "c", prompts["c"])
    assert_same_answer([lp for out in outputs["c"] for lp in out.logprobs or []], fresh)


@pytest.mark.usefixtures("one_torch_thread")
def test_without_prefix_caching_every_prompt_is_prefilled_whole(embedded_model):
    doc = document(200)
    engine = make_engine(embedded_model, **LONG, prefix_caching=False)
    answer(engine, "first", doc + [1])
    _, cost = answer(engine, "second", doc + [2])
    assert cost == 201 and engine.stats()["prefix_cache"] is None


@pytest.mark.usefixtures("one_torch_thread")
def test_new_weights_clear_the_cache(embedded_model):
    doc = document(200)
    engine = make_engine(embedded_model, **LONG)
    answer(engine, "first", doc + [1])
    engine.reload_weights(engine.model.state_dict())
    _, cost = answer(engine, "second", doc + [2])
    assert cost == 201


def pool(num_blocks: int = 6) -> PagedKVStorage:
    return PagedKVStorage(
        num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=2,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip


def test_a_freed_cached_block_is_reused_for_new_kv_last_and_then_forgotten():
    kv = pool()
    (a, b) = kv.allocate(2)
    hashes = prefix_hashes([1, 2, 3, 4], 2, 2)
    kv.register(a, hashes[0])
    kv.register(b, hashes[1])
    kv.free([a, b])
    assert kv.num_free_blocks == 5 and kv.cached_prefix(hashes) == [a, b]
    others = kv.allocate(3)  # the free blocks first
    assert a not in others and b not in others and kv.cached_prefix(hashes) == [a, b]
    (evicted,) = kv.allocate(1)  # then the least recently freed cached block
    assert evicted == a and kv.cached_prefix(hashes) == []


def test_a_claimed_prefix_is_held_and_an_equal_block_needs_an_equal_prefix():
    kv = pool()
    (a,) = kv.allocate(1)
    kv.register(a, prefix_hashes([5, 6], 2, 1)[0])
    kv.free([a])
    assert kv.claim_prefix(kv.cached_prefix(prefix_hashes([5, 6, 7, 8], 2, 2))) == [a]
    assert kv.num_holders(a) == 1
    assert kv.cached_prefix(prefix_hashes([9, 5, 6, 7], 2, 2)) == []  # same block, other prefix


def test_images_and_prompt_logprobs_are_not_served_from_the_cache():
    kv = pool()
    cache = PrefixCache(kv)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    seq.block_table = cache.claim(seq, []) + kv.allocate(3)  # admitted: its KV may be cached
    cache.register(seq, 4)
    assert cache.reusable(Sequence("b", [1, 2, 3, 4, 9], SamplingParams())) != []
    with_image = Sequence("c", [1, 2, 3, 4, 9], SamplingParams())
    with_image.image_positions = [0]
    scored = Sequence("d", [1, 2, 3, 4, 9], SamplingParams(prompt_logprobs=1))
    assert cache.reusable(with_image) == [] and cache.reusable(scored) == []


def test_prefix_hashes_extend_the_known_ones_to_the_same_chain():
    tokens = list(range(10))
    known = prefix_hashes(tokens, 2, 2)
    assert prefix_hashes(tokens, 2, 5, known) == prefix_hashes(tokens, 2, 5)
    assert prefix_hashes(tokens, 2, 1, known) == known[:1]


def scheduler_over(num_blocks: int, budget: int, block_size: int = 16) -> Scheduler:
    kv = PagedKVStorage(
        num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks + 1,
        block_size=block_size, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    return Scheduler(
        kv, max_num_seqs=8, max_num_batched_tokens=budget, prefix_cache=PrefixCache(kv)
    )


def step(scheduler: Scheduler) -> dict[str, int]:
    """One step as the engine runs it (a token for each row that completes); the tokens each
    prefill ran, by request."""
    batch = scheduler.schedule()
    scheduler.advance(batch)
    for seq, completes in zip(batch.seqs, batch.completes, strict=True):
        if completes:
            seq.append_token(7)
    return {chunk.seq.request_id: chunk.num_tokens for chunk in batch.prefills}


def test_requests_arriving_together_over_one_document_compute_it_once():
    doc = document(512)  # 32 blocks; the budget would fit two of these prompts in one step
    scheduler = scheduler_over(num_blocks=128, budget=1024)
    for name, question in (("a", [1, 2]), ("b", [3, 4, 5]), ("c", [6])):
        scheduler.add(Sequence(name, doc + question, SamplingParams()))
    scheduler.add(Sequence("other", list(range(5000, 5040)), SamplingParams()))
    # b and c wait for a's blocks; `other` shares nothing and does not wait behind them
    assert step(scheduler) == {"a": 514, "other": 40}
    assert step(scheduler) == {"b": 3, "c": 1}  # then reuse all 32 of them
    assert scheduler.prefix_cache.stats()["hit_tokens"] == 2 * 512


def test_a_prefix_written_in_chunks_is_waited_for_until_it_is_written():
    doc = document(1024)  # a writes it in chunks of 512 tokens
    scheduler = scheduler_over(num_blocks=160, budget=768)
    scheduler.add(Sequence("a", doc + [1], SamplingParams()))
    scheduler.add(Sequence("b", doc + [2], SamplingParams()))
    assert step(scheduler) == {"a": 768}  # b waits while a writes the blocks it needs...
    assert step(scheduler) == {"a": 257}
    assert step(scheduler) == {"b": 1}  # ...then reuses all 64
    assert scheduler.num_prefilled_tokens == 1025 + 1


def test_a_short_shared_run_is_computed_again_rather_than_waited_for():
    head = document(128)  # 8 blocks, under MIN_WAIT_TOKENS
    assert len(head) < MIN_WAIT_TOKENS
    scheduler = scheduler_over(num_blocks=64, budget=512)
    scheduler.add(Sequence("a", head + [1], SamplingParams()))
    scheduler.add(Sequence("b", head + [2], SamplingParams()))
    assert step(scheduler) == {"a": 129, "b": 129}  # both start at once


def test_a_waiting_request_computes_the_document_itself_when_its_writer_is_aborted():
    doc = document(512)
    scheduler = scheduler_over(num_blocks=128, budget=128)
    scheduler.add(Sequence("a", doc + [1], SamplingParams()))
    scheduler.add(Sequence("b", doc + [2], SamplingParams()))
    assert step(scheduler) == {"a": 128}
    scheduler.abort("a")  # its 8 written blocks stay cached
    assert step(scheduler) == {"b": 128}  # from block 8 on, itself
    assert scheduler.running[0].num_cached_tokens == 256  # 8 blocks reused, 8 computed


def test_a_waiting_request_keeps_its_place_against_the_ones_behind_it():
    doc = document(1024)
    scheduler = scheduler_over(num_blocks=200, budget=2048)
    scheduler.max_num_seqs = 2
    scheduler.add(Sequence("r", doc + [1], SamplingParams()))
    scheduler.add(Sequence("w", doc + [2], SamplingParams()))  # waits for r's blocks...
    scheduler.add(Sequence("x", list(range(9000, 9010)), SamplingParams(max_tokens=1000)))
    assert step(scheduler) == {"r": 1025}  # ...holding its slot: x may not take it
    assert step(scheduler) == {"w": 1}
    assert [seq.request_id for seq in scheduler.waiting] == ["x"]


def test_kv_written_before_the_cache_was_cleared_is_never_cached():
    doc = document(1024)
    scheduler = scheduler_over(num_blocks=200, budget=512)
    scheduler.add(Sequence("old", doc + [1], SamplingParams()))
    step(scheduler)  # its first 512 tokens, with the old weights
    scheduler.kv.clear_prefix_cache()  # new weights
    step(scheduler)
    step(scheduler)  # the rest written and the request decoding
    scheduler.abort("old")
    assert scheduler.prefix_cache.reusable(Sequence("new", doc + [2], SamplingParams())) == []
    assert scheduler.kv.num_cached_blocks == 0


def counting_digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the block digests computed from now on (one element per digest)."""
    calls: list[int] = []
    real = kv_module.hashlib.blake2b

    def blake2b(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_module.hashlib, "blake2b", blake2b)
    return calls


def test_a_prompt_that_starts_as_a_recent_one_hashes_only_the_blocks_after_their_common_part(
    monkeypatch: pytest.MonkeyPatch,
):
    recent = RecentPrompts()
    document = list(range(100, 164))  # 16 blocks of 4
    first = document + [1, 2, 3, 4, 5, 6, 7, 8]
    assert recent.hashes(token_bytes(first, 4, 18), 4, []) == prefix_hashes(first, 4, 18)
    digests = counting_digests(monkeypatch)
    second = document + [1, 2, 9, 9, 9, 9]  # the same document, another question mid-block
    assert recent.hashes(token_bytes(second, 4, 17), 4, []) == prefix_hashes(second, 4, 17)
    assert len(digests) - 17 == 1  # the block after the document, then the reference's 17
    digests.clear()
    other = [7] + document[1:]  # another first block: nothing in common
    assert recent.hashes(token_bytes(other, 4, 16), 4, []) == prefix_hashes(other, 4, 16)
    assert len(digests) == 2 * 16


def test_recent_prompts_keep_the_longer_prompt_and_forget_the_least_recent(
    monkeypatch: pytest.MonkeyPatch,
):
    recent = RecentPrompts(capacity=2)
    long = list(range(40))
    recent.hashes(token_bytes(long, 4, 10), 4, [])
    recent.hashes(token_bytes(long[:8], 4, 2), 4, [])  # a prefix of it: the long one stays
    digests = counting_digests(monkeypatch)
    assert recent.hashes(token_bytes(long, 4, 10), 4, []) == prefix_hashes(long, 4, 10)
    assert len(digests) == 10  # the reference's: none for the remembered one
    for start in (1000, 2000):  # two other documents push it out
        recent.hashes(token_bytes(list(range(start, start + 8)), 4, 2), 4, [])
    digests.clear()
    recent.hashes(token_bytes(long, 4, 10), 4, [])
    assert len(digests) == 10


def test_a_prompts_intake_bytes_are_what_its_blocks_hash_and_any_other_prompt_still_hashes(
    monkeypatch: pytest.MonkeyPatch,
):
    ids = list(range(300, 340))
    seq = Sequence("a", ids, SamplingParams())
    seq.prompt_bytes = check_request(ids, SamplingParams(), RequestLimits(1000, 100, 4, 50))
    with monkeypatch.context() as patched:  # no conversion of its tokens again
        patched.setattr(prefix_cache_module, "token_bytes", None)
        assert PrefixCache(pool()).reusable(seq) == []
    assert seq.prefix_hashes == prefix_hashes(ids, 2, 20)
    bare = Sequence("b", ids, SamplingParams())  # made without the engine's intake
    PrefixCache(pool()).reusable(bare)
    assert bare.prefix_hashes == seq.prefix_hashes


def registered(cache: PrefixCache, request_id: str, tokens: list[int]) -> Sequence:
    """A sequence admitted with fresh blocks, its whole prompt written and cached."""
    seq = Sequence(request_id, tokens, SamplingParams())
    blocks = -(-len(tokens) // cache.block_size)
    seq.block_table = cache.claim(seq, []) + cache.kv.allocate(blocks)
    cache.register(seq, len(tokens))
    return seq


def test_a_prompt_sharing_a_later_block_but_not_the_blocks_before_it_reuses_none_of_it():
    cache = PrefixCache(pool())  # blocks of 2 tokens
    first = registered(cache, "a", [1, 2, 3, 4, 5, 6, 9])  # P, X, D, one more token
    second = Sequence("b", [1, 2, 5, 6, 9], SamplingParams())  # P, D, ...: D after another prefix
    assert cache.reusable(second) == first.block_table[:1]  # P only, never D's KV


def test_equal_hashes_mean_equal_whole_prefixes_in_a_reference_of_the_chain():
    import hashlib

    def reference(tokens: list[int]) -> list[bytes]:
        out, previous = [], b""
        for start in range(0, len(tokens) - 1, 2):
            data = torch.tensor(tokens[start : start + 2], dtype=torch.int64).numpy().tobytes()
            previous = hashlib.blake2b(previous + data, digest_size=16).digest()
            out.append(previous)
        return out

    tokens = [3, 1, 4, 1, 5, 9]
    assert prefix_hashes(tokens, 2, 3) == reference(tokens)
    assert prefix_hashes([7, 7, 4, 1], 2, 2)[1] != prefix_hashes(tokens, 2, 2)[1]


def test_the_last_prompt_token_of_a_block_aligned_prompt_is_always_computed():
    cache = PrefixCache(pool())
    first = registered(cache, "a", [1, 2, 3, 4])  # two whole blocks
    again = Sequence("b", [1, 2, 3, 4], SamplingParams())
    assert cache.reusable(again) == first.block_table[:1]  # its last block is computed again


def test_a_block_aligned_prompt_sent_twice_answers_as_a_fresh_engine(tiny_qwen3):
    prompt = document(32)  # two blocks of 16: every token in a full block
    fresh = make_engine(tiny_qwen3, enforce_eager=True, block_size=16)
    expected, _ = answer(fresh, "a", prompt)
    engine = make_engine(tiny_qwen3, enforce_eager=True, block_size=16)
    answer(engine, "a", prompt)
    got, num_computed = answer(engine, "b", prompt)
    assert num_computed == 16 and [lp.token_id for lp in got] == [lp.token_id for lp in expected]
    assert_same_answer(got, expected)


def test_the_blocks_of_a_request_with_images_are_never_cached():
    kv = pool()
    cache = PrefixCache(kv)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    seq.image_positions = [0]  # its KV depends on the image, not only on the tokens
    seq.block_table = cache.claim(seq, []) + kv.allocate(3)
    cache.register(seq, 4)
    assert kv.num_cached_blocks == 0
    assert cache.reusable(Sequence("b", [1, 2, 3, 4, 9], SamplingParams())) == []


def admitted(cache: PrefixCache, request_id: str, tokens: list[int], **params) -> Sequence:
    """A sequence admitted with nothing reused: what it writes is cached."""
    seq = Sequence(request_id, tokens, SamplingParams(**params))
    seq.block_table = cache.claim(seq, []) + cache.kv.allocate(-(-len(tokens) // 2))
    return seq


def test_the_blocks_computing_are_the_full_ones_a_prefill_has_yet_to_write():
    cache = PrefixCache(pool(num_blocks=16))  # blocks of 2 tokens
    decoding = admitted(cache, "d", [7, 8, 9])
    decoding.num_cached_tokens = 3
    decoding.append_token(10)  # its prompt written: it writes none of a prompt's blocks
    with_image = admitted(cache, "i", [5, 6, 7, 8, 9])
    with_image.image_positions = [0]  # its blocks are never cached
    prefilling = admitted(cache, "p", [1, 2, 3, 4, 5])
    prefilling.num_cached_tokens = 3  # blocks [1, 2] written, [3, 4] half, [5] not full
    found = cache.computing([decoding, with_image, prefilling])
    assert found == {prefix_hashes([1, 2, 3, 4, 5], 2, 2)[1]}


def test_the_blocks_coming_are_those_in_a_row_after_the_reused_ones_that_a_prefill_writes():
    cache = PrefixCache(pool(num_blocks=16))  # blocks of 2 tokens
    doc = [1, 2, 3, 4, 5, 6]  # three blocks
    computing = cache.computing([admitted(cache, "w", doc + [7])])
    reader = Sequence("r", doc + [8], SamplingParams())
    assert cache.coming(reader, [], computing) == 3
    assert cache.coming(reader, [11], computing) == 2  # after the one block it reuses
    assert cache.coming(reader, [], set()) == 0
    aligned = Sequence("a", doc, SamplingParams())  # its last block is computed anyway
    assert cache.coming(aligned, [], computing) == 2
    scored = Sequence("s", doc + [8], SamplingParams(prompt_logprobs=1))  # reuses nothing
    assert cache.coming(scored, [], computing) == 0


def test_stats_give_the_hit_rate_to_four_places_the_hit_tokens_and_the_cached_blocks():
    cache = PrefixCache(pool(num_blocks=16))
    registered(cache, "a", [1, 2, 3, 4, 5])  # 5 tokens looked up, none hit; 2 blocks cached
    second = Sequence("b", [1, 2, 3, 4, 9, 9, 9], SamplingParams())
    cache.claim(second, cache.reusable(second))  # 7 tokens looked up, 4 hit
    assert cache.stats() == {"hit_rate": 0.3333, "hit_tokens": 4, "cached_blocks": 2}


def test_the_common_blocks_of_two_prompts_are_their_leading_equal_blocks():
    assert _common_blocks(b"aabbcc", b"aabbcc", 2) == 3
    assert _common_blocks(b"aabbcc", b"aabb", 2) == 2  # the shorter one ends
    blocks = [bytes([i, i]) for i in range(9)]
    for differing in range(9):  # equal blocks after the differing one are not common
        other = blocks[:differing] + [b"xx"] + blocks[differing + 1 :]
        assert _common_blocks(b"".join(blocks), b"".join(other), 2) == differing


def test_requests_share_cached_blocks_only_within_one_cache_salt():
    cache = PrefixCache(pool(num_blocks=16))
    tokens = [1, 2, 3, 4, 5]
    plain = registered(cache, "plain", tokens)
    salted = Sequence("a", tokens, SamplingParams(cache_salt="tenant-a"))
    assert cache.reusable(salted) == []  # the same tokens, cached without a salt
    salted.block_table = cache.claim(salted, []) + cache.kv.allocate(3)
    cache.register(salted, len(tokens))
    same = Sequence("b", tokens, SamplingParams(cache_salt="tenant-a"))
    assert cache.reusable(same) == salted.block_table[:2]
    assert cache.reusable(Sequence("c", tokens, SamplingParams(cache_salt="tenant-b"))) == []
    assert cache.reusable(Sequence("d", tokens, SamplingParams())) == plain.block_table[:2]


def test_a_prompt_shorter_than_a_block_has_no_hashes_and_one_of_a_block_has_one():
    recent = RecentPrompts()
    assert recent.hashes(token_bytes([1], 2, 1), 2, []) == []
    assert recent.hashes(token_bytes([1, 2], 2, 1), 2, []) == prefix_hashes([1, 2], 2, 1)


def test_a_prompt_of_one_block_and_a_token_more_reuses_that_block():
    cache = PrefixCache(pool())
    first = registered(cache, "a", [1, 2, 3])
    assert cache.reusable(Sequence("b", [1, 2, 9], SamplingParams())) == first.block_table[:1]


def test_the_hashes_a_sequence_has_are_not_computed_again(monkeypatch: pytest.MonkeyPatch):
    cache = PrefixCache(pool())
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())  # no intake bytes: converted here
    reused = cache.reusable(seq)
    monkeypatch.setattr(prefix_cache_module, "token_bytes", None)  # no conversion again
    assert cache.reusable(seq) == reused and seq.prefix_hashes == prefix_hashes(seq.token_ids, 2, 2)
