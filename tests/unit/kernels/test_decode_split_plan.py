"""The split plan of the Triton decode attention (graphguard/kernels/triton_decode.py): what it
picks for long contexts and large batches, that every plan gives the reference's attention, and
the invariant it keeps: a row computes the same bits in any batch, unpadded or padded to a
bucket (its own, or a larger one it rides). Run by Triton's CPU interpreter, at small sizes."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
pytest.importorskip("triton")

from graphguard.core.keys import Buckets  # noqa: E402
from graphguard.engine.config import GraphConfig  # noqa: E402
from graphguard.engine.shapes import DECODE_PAD, width_bucket  # noqa: E402
from graphguard.kernels import HeadShape, triton_decode  # noqa: E402
from graphguard.kernels.decode_plan import SPLIT_RULE, SplitPlan, SplitRule, plan_splits  # noqa: E402
from tests.kernel_cases import BLOCK_SIZE, HEADS, REFERENCE, paged_batch, rel_error  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels were imported for the device", allow_module_level=True)

TOLERANCE = {torch.float16: 6e-3, torch.float32: 2e-5}
WIDTHS_TOKENS = [128, 256, 512, 2048, 8192, 32768, 131072]


def programs(plan: SplitPlan, kv_heads: int) -> int:
    """One row's programs."""
    return kv_heads * plan.num_splits


def reference(q, cache, tables, seq_lens, scale):
    return REFERENCE.decode_attention(
        q.float(), (cache[0].float(), cache[1].float()), tables, seq_lens, scale
    )


@pytest.mark.parametrize("kv_heads", [1, 3, 8])
def test_a_plan_covers_the_context_in_whole_tiles_of_long_enough_splits(kv_heads):
    for ctx in WIDTHS_TOKENS:
        plan = plan_splits(ctx, kv_heads)
        assert (
            plan.num_splits * plan.split_tokens >= ctx > (plan.num_splits - 1) * plan.split_tokens
        )
        assert plan.split_tokens % plan.block_n == 0
        assert 1 <= plan.num_splits <= SPLIT_RULE.max_splits
        if plan.num_splits > 1:
            assert plan.split_tokens >= SPLIT_RULE.min_split_tokens
            assert programs(plan, kv_heads) <= SPLIT_RULE.row_programs


def test_short_contexts_are_one_split():
    for ctx in (128, SPLIT_RULE.direct_tokens):
        assert plan_splits(ctx, 8).num_splits == 1


def table_slots(context: int) -> int:
    """The slots of the block table a row of `context` tokens decodes over (its width
    rounded up to a power of two of blocks, as the engine pads it)."""
    return width_bucket(-(-(context + 1) // BLOCK_SIZE)) * BLOCK_SIZE


def working(plan: SplitPlan, kv_heads: int, context: int) -> int:
    """One row's programs whose split holds tokens of its `context` tokens."""
    return kv_heads * min(plan.num_splits, -(-context // plan.split_tokens))


@pytest.mark.parametrize("context", [8192, 32768])
def test_one_row_of_a_long_context_keeps_hundreds_of_programs_working(context):
    plan = plan_splits(table_slots(context), 8)  # the 8 KV heads of Qwen3-0.6B and Llama 8B
    assert working(plan, 8, context) >= SPLIT_RULE.row_programs // 2


def test_longer_contexts_take_longer_splits_once_the_row_has_its_programs():
    plans = [plan_splits(table_slots(1 << i), 8) for i in range(9, 17)]
    assert [p.num_splits for p in plans] == sorted(p.num_splits for p in plans)
    assert plans[-1].split_tokens > plans[-2].split_tokens > plans[-3].split_tokens


# (lens, width in blocks): one split; several splits in one merge chunk; more splits (20) than a
# merge chunk; rows that end inside a split, a padding row of length 0
PLANNED_CASES = [([37, 200], 16), ([700, 1, 1024], 64), ([5000], 320), ([0, 900, 513], 64)]
DTYPES = {"float16": torch.float16, "float32": torch.float32}


def planned_cases() -> list:
    """Each case with each head shape, the dtype alternating over those pairs, so that every
    case and every head shape also runs in both dtypes: every pair of the three is covered (the
    full product took twice the interpreter's time and covered no other pair)."""
    cases = []
    for i, (lens, width) in enumerate(PLANNED_CASES):
        for j, (heads, name) in enumerate(zip(HEADS, ("smollm2", "qwen3"), strict=True)):
            dtype = list(DTYPES)[(i + j) % 2]
            cases.append(
                pytest.param(lens, width, heads, DTYPES[dtype], id=f"case{i}-{name}-{dtype}")
            )
    return cases


@pytest.mark.parametrize("lens,width,heads,dtype", planned_cases())
def test_the_planned_attention_matches_the_reference(lens, width, heads, dtype):
    q, cache, tables, seq_lens = paged_batch(heads, lens, width, dtype, "cpu")
    scale = heads.head_dim**-0.5
    actual = triton_decode.decode_attention(q, cache, tables, seq_lens, scale)
    real = seq_lens > 0
    expected = reference(q, cache, tables, seq_lens, scale)
    assert rel_error(actual[real], expected[real]) < TOLERANCE[dtype]
    assert not actual[~real].any()


# Rules other than the default: tiles of 32 and 128 with their warps and stages, more splits
# than a merge chunk with a last chunk of one split, one split over the whole context, a merge
# of 4 programs a head (16 dims each at head_dim 64) and of more than the head has dims for, a
# merge of 8 programs that loads all 17 splits at once (a chunk of 32, partly past the splits),
# the wide merge (8 programs, a chunk of 64) from 16 splits on instead of 64.
OTHER_RULES = [
    SplitRule(min_split_tokens=64, block_n=32, num_warps=2),
    SplitRule(min_split_tokens=128, block_n=128, num_warps=8, num_stages=3),
    SplitRule(min_split_tokens=64, row_programs=17 * 8, max_splits=64),
    SplitRule(direct_tokens=1 << 20),
    SplitRule(min_split_tokens=64, row_programs=17 * 8, max_splits=64, merge_programs=4),
    SplitRule(min_split_tokens=64, merge_programs=64),
    SplitRule(
        min_split_tokens=64, row_programs=17 * 8, max_splits=64, merge_programs=8, merge_chunk=32
    ),  # fmt: skip
    SplitRule(min_split_tokens=64, row_programs=17 * 8, max_splits=64, wide_merge_splits=16),
]
RULE_IDS = [
    "tiles32", "tiles128", "chunks2", "direct", "merge4", "merge_past_dims", "chunk32", "wide",
]  # fmt: skip


@pytest.mark.parametrize("rule", OTHER_RULES, ids=RULE_IDS)
def test_any_rule_gives_the_reference(rule):
    heads = HEADS[1]
    q, cache, tables, seq_lens = paged_batch(heads, [1088, 77, 500], 68, torch.float32, "cpu")
    actual = triton_decode.decode_attention(q, cache, tables, seq_lens, 0.1, rule=rule)
    assert rel_error(actual, reference(q, cache, tables, seq_lens, 0.1)) < TOLERANCE[torch.float32]


def test_launches_of_many_splits_merge_wide_and_short_ones_narrow():
    """A 30k row's 64 partials in one round trip of 8 programs a head; a 2k context's 8
    splits (and a 512-token one's 2) in one program a head, as before."""
    rule = SPLIT_RULE
    long, short = plan_splits(32768, 8), plan_splits(2048, 8)
    assert long.num_splits == rule.wide_merge_splits == 64
    assert (long.merge_programs, long.merge_chunk) == (8, 64)
    assert short.num_splits < rule.wide_merge_splits
    assert (short.merge_programs, short.merge_chunk) == (rule.merge_programs, rule.merge_chunk)


def test_an_unusable_rule_is_refused():
    for bad in (dict(block_n=48), dict(block_n=8), dict(row_programs=0)):
        with pytest.raises(ValueError, match="unusable"):
            SplitRule(**bad)
    for merge in (0, 3):
        with pytest.raises(ValueError, match="merge_programs must be a power of two"):
            SplitRule(merge_programs=merge)
        with pytest.raises(ValueError, match="merge_chunk must be a power of two"):
            SplitRule(merge_chunk=merge)
        with pytest.raises(ValueError, match="wide_merge_programs must be a power of two"):
            SplitRule(wide_merge_programs=merge)


def test_a_merge_of_several_programs_a_head_gives_the_bits_of_one():
    """Each program of a head computes the same weights from the same log-sum-exps; only
    which dimensions it sums differs. In the interpreter the bits are equal; on the device
    a plan's merge is fixed by the rule, whatever the batch."""
    heads = HEADS[1]
    q, cache, tables, seq_lens = paged_batch(heads, [1088, 77, 500], 68, torch.float32, "cpu")
    rule = SplitRule(min_split_tokens=64, row_programs=17 * 8, max_splits=64)
    assert rule.plan(68 * BLOCK_SIZE, heads.num_kv_heads).num_splits > rule.merge_chunk
    one = triton_decode.decode_attention(q, cache, tables, seq_lens, 0.1, rule=rule)
    four = dataclasses.replace(rule, merge_programs=4)
    assert torch.equal(one, triton_decode.decode_attention(q, cache, tables, seq_lens, 0.1, four))


def test_a_head_narrower_than_a_merge_programs_share_merges_in_one_program():
    """head_dim 8 (the tiny test models'): any rule's merge takes the head whole."""
    heads = HeadShape(4, 2, 8)
    q, cache, tables, seq_lens = paged_batch(heads, [300, 40], 20, torch.float32, "cpu")
    for merge in (1, 4):
        rule = SplitRule(min_split_tokens=64, merge_programs=merge)
        assert rule.plan(20 * BLOCK_SIZE, heads.num_kv_heads).num_splits > 1
        actual = triton_decode.decode_attention(q, cache, tables, seq_lens, 0.1, rule=rule)
        expected = reference(q, cache, tables, seq_lens, 0.1)
        assert rel_error(actual, expected) < TOLERANCE[torch.float32]


def pad_to(rows: int, q, tables, seq_lens):
    """The batch as the decode path pads it to `rows` (graphguard/engine/shapes.py DECODE_PAD):
    padding rows over the dummy block with length 1."""
    pad = rows - q.shape[0]
    _, _, pad_block, pad_len, _ = DECODE_PAD
    return (
        torch.cat([q, torch.randn(pad, *q.shape[1:]).to(q.dtype)]),
        torch.cat([tables, torch.full((pad, tables.shape[1]), pad_block, dtype=tables.dtype)]),
        torch.cat([seq_lens, torch.full((pad,), pad_len, dtype=seq_lens.dtype)]),
    )


# A rule small enough for the interpreter that still splits these rows' 2,048-slot width.
SMALL_RULE = SplitRule(row_programs=16, min_split_tokens=64)


# two batches that each pad to a larger bucket (4 and 8) and ride the one above it (8 and 16)
@pytest.mark.parametrize("num_rows", [3, 6])
def test_a_row_gives_the_same_bits_unpadded_in_its_bucket_and_riding_a_larger_one(num_rows):
    heads = HEADS[0]
    bucket = Buckets(GraphConfig().batch_buckets).bucket_for(num_rows)
    assert bucket is not None and bucket > num_rows
    lens = [700 - 50 * i for i in range(num_rows)]  # the plan reads the width, not these
    q, cache, tables, seq_lens = paged_batch(heads, lens, 128, torch.float16, "cpu")
    assert SMALL_RULE.plan(128 * BLOCK_SIZE, heads.num_kv_heads).num_splits > 1
    eager = triton_decode.decode_attention(q, cache, tables, seq_lens, 0.1, rule=SMALL_RULE)
    for rows in (bucket, 2 * bucket):  # its own bucket's graph, and one it rides
        padded_q, padded_tables, padded_lens = pad_to(rows, q, tables, seq_lens)
        padded = triton_decode.decode_attention(
            padded_q, cache, padded_tables, padded_lens, 0.1, rule=SMALL_RULE
        )
        assert torch.equal(eager, padded[:num_rows])


def test_a_rows_output_does_not_depend_on_the_other_rows():
    heads = HEADS[0]
    q, cache, tables, seq_lens = paged_batch(heads, [900, 5, 77], 64, torch.float16, "cpu")
    first = triton_decode.decode_attention(q, cache, tables, seq_lens, 0.1)
    others = q.clone()
    others[1:] = torch.randn_like(others[1:].float()).to(others.dtype)
    lens = seq_lens.clone()
    lens[1:] = torch.tensor([1000, 3], dtype=lens.dtype)
    second = triton_decode.decode_attention(others, cache, tables, lens, 0.1)
    assert torch.equal(first[0], second[0])
