"""Paged attention: decode against a dense reference, width padding, cached-prefix prefill,
grouped prefill of many sequences."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphguard.engine.models.attention import (
    MAX_GROUP_AREA,
    MAX_GROUPED_LEN,
    MAX_PAD_RATIO,
    SMALL_GROUP_AREA,
    AttentionMetadata,
    PrefillGroup,
    paged_prefill_attention,
    plan_prefill_groups,
)
from graphguard.kernels.reference import decode_attention as paged_decode_attention
from graphguard.kernels.reference import write_kv


def per_sequence_groups(
    query_lens: list[int], seq_lens: list[int], device: torch.device | str
) -> tuple[PrefillGroup, ...]:
    """A plan with every sequence in a group of its own: one attention call per sequence and
    layer (the reference the grouped plan is measured and tested against)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return tuple(
        PrefillGroup(1, q, starts[i], starts[i + 1])
        if q == s
        else PrefillGroup(1, q, starts[i], starts[i + 1], i, s)
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
    )


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 16
SCALE = HEAD_DIM**-0.5


def random_cache(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def contiguous(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    return cache[torch.tensor(table)].flatten(0, 1)[:length]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query row per head over all of k/v: q [Hq, D], k/v [T, Hkv, D] -> [Hq, D]."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,thd->ht", q, k) * SCALE, dim=-1)
    return torch.einsum("ht,thd->hd", probs, v)


TABLES = [[3, 7, 1], [5, 2, 0], [9, 0, 0]]  # padded with DUMMY_BLOCK 0
SEQ_LENS = [11, 5, 1]


def test_decode_matches_dense_attention_over_each_context() -> None:
    k_cache, v_cache = random_cache()
    q = torch.randn(len(TABLES), NUM_HEADS, HEAD_DIM)
    tables = torch.tensor(TABLES, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(SEQ_LENS), SCALE)
    for row, (table, seq_len) in enumerate(zip(TABLES, SEQ_LENS, strict=True)):
        k, v = contiguous(k_cache, table, seq_len), contiguous(v_cache, table, seq_len)
        torch.testing.assert_close(out[row], dense_attention(q[row], k, v))


def test_decode_is_unchanged_by_padding_the_table_width_with_dummy_blocks() -> None:
    k_cache, v_cache = random_cache()
    q = torch.randn(len(TABLES), NUM_HEADS, HEAD_DIM)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    narrow = torch.tensor(TABLES, dtype=torch.int32)
    wide = torch.cat([narrow, torch.zeros(len(TABLES), 5, dtype=torch.int32)], dim=1)
    k_cache[0].normal_()  # the dummy block holds garbage from padded rows
    expected = paged_decode_attention(q, k_cache, v_cache, narrow, seq_lens, SCALE)
    actual = paged_decode_attention(q, k_cache, v_cache, wide, seq_lens, SCALE)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


class HostSyncRecorder(TorchDispatchMode):
    """Records the ops a CUDA graph capture rejects (host reads of device values)."""

    SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"}

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        indices = args[1] if name in ("aten::index", "aten::index_put_") else ()
        if name in self.SYNC_OPS or any(_is_bool(i) for i in indices):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _is_bool(index: object) -> bool:
    # Boolean-mask indexing hides a nonzero() (a host sync) inside the index kernel.
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


def test_host_sync_recorder_sees_item_and_mask_indexing() -> None:
    x = torch.arange(4.0)
    with HostSyncRecorder() as recorder:
        x[x > 1].sum().item()
    assert len(recorder.syncs) == 2


def test_decode_makes_no_host_syncs() -> None:
    k_cache, v_cache = random_cache()
    q = torch.randn(len(TABLES), NUM_HEADS, HEAD_DIM)
    k_new = torch.randn(len(TABLES), NUM_KV_HEADS, HEAD_DIM)
    tables = torch.tensor(TABLES, dtype=torch.int32)
    with HostSyncRecorder() as recorder:
        write_kv(k_cache, v_cache, k_new, k_new, torch.tensor([0, 1, 2]))
        paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(SEQ_LENS), SCALE)
    assert recorder.syncs == []


def prefill_meta(table: list[int], seq_len: int, query_len: int) -> AttentionMetadata:
    positions = range(seq_len - query_len, seq_len)
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    return AttentionMetadata(
        packed=True,
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([table], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens_cpu=[seq_len],
        query_lens_cpu=[query_len],
    )


def test_prefill_over_a_cached_prefix_equals_one_full_prefill() -> None:
    table, seq_len, split = [4, 8, 6], 10, 7
    q = torch.randn(seq_len, NUM_HEADS, HEAD_DIM)
    k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
    full_cache = random_cache()
    meta = prefill_meta(table, seq_len, seq_len)
    write_kv(*full_cache, k, v, meta.slot_mapping)
    expected = paged_prefill_attention(q, k, v, *full_cache, meta, SCALE)

    split_cache = random_cache(seed=1)
    first, second = prefill_meta(table, split, split), prefill_meta(table, seq_len, seq_len - split)
    write_kv(*split_cache, k[:split], v[:split], first.slot_mapping)
    write_kv(*split_cache, k[split:], v[split:], second.slot_mapping)
    actual = paged_prefill_attention(q[split:], k[split:], v[split:], *split_cache, second, SCALE)
    torch.testing.assert_close(actual, expected[split:])


def test_prefill_is_causal() -> None:
    table, seq_len = [4, 8, 6], 9
    q = torch.randn(seq_len, NUM_HEADS, HEAD_DIM)
    k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
    meta = prefill_meta(table, seq_len, seq_len)
    cache = random_cache()
    write_kv(*cache, k, v, meta.slot_mapping)
    out = paged_prefill_attention(q, k, v, *cache, meta, SCALE)
    for t in (0, 4, 8):
        torch.testing.assert_close(out[t], dense_attention(q[t], k[: t + 1], v[: t + 1]))


def test_prefill_groups_cover_every_sequence_once_within_the_pad_ratio() -> None:
    lens = [10, 9, 10, 3, 300, 1, 137, 12, 12, 2, 250]
    groups = plan_prefill_groups(lens, lens, "cpu")
    assert groups is not None and len(groups) < len(lens)
    rows: list[int] = []
    for group in groups:
        if group.gather is None:
            rows += range(group.start, group.end)
            continue
        assert group.dest is not None and group.mask is not None
        # The mask's allowed (query, key) pairs of real rows: each sequence's causal triangle.
        area = group.num_seqs * group.length**2
        seq_lens = group.mask[:, 0, -1, :].sum(dim=-1).tolist()  # the last query sees them all
        real = sum(n * n for n in seq_lens)
        assert area <= max(MAX_PAD_RATIO * real, SMALL_GROUP_AREA) and area <= MAX_GROUP_AREA
        assert group.length <= MAX_GROUPED_LEN
        assert sum(seq_lens) == group.dest.numel()
        rows += group.dest.tolist()
    assert sorted(rows) == list(range(sum(lens)))


def test_a_continued_prefill_is_a_group_of_one_over_its_cache() -> None:
    groups = plan_prefill_groups([3, 4, 3], [3, 9, 3], "cpu")
    continued = [g for g in groups if g.cached_row is not None]
    assert len(continued) == 1 and continued[0].cached_row == 1
    assert continued[0].context_len == 9 and (continued[0].start, continued[0].end) == (3, 7)
    # The two fresh three-token prompts still share one padded call.
    assert [g.num_seqs for g in groups if g.cached_row is None] == [2]


def test_grouped_prefill_with_a_continued_prefill_equals_one_at_a_time() -> None:
    # Row 0: a fresh 4-token prompt. Row 1: tokens 7..9 of a sequence whose first 7 are cached.
    tables = [[3, 7, 1], [5, 2, 6]]
    query_lens, seq_lens = [4, 3], [4, 10]
    slots = [tables[0][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(4)]
    slots += [tables[1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(7, 10)]
    q = torch.randn(7, NUM_HEADS, HEAD_DIM)
    k = torch.randn(7, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(7, NUM_KV_HEADS, HEAD_DIM)
    cache = random_cache()  # row 1's cached tokens are whatever the cache holds
    write_kv(*cache, k, v, torch.tensor(slots))

    def meta(grouped: bool) -> AttentionMetadata:
        plan = plan_prefill_groups if grouped else per_sequence_groups
        return AttentionMetadata(
            packed=True,
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor([0, 4, 7], dtype=torch.int32),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
            prefill_groups=plan(query_lens, seq_lens, "cpu"),
        )

    grouped = paged_prefill_attention(q, k, v, *cache, meta(True), SCALE)
    alone = paged_prefill_attention(q, k, v, *cache, meta(False), SCALE)
    torch.testing.assert_close(grouped, alone)
    # Row 1's last token sees its whole context through the cache.
    context_k = contiguous(cache[0], tables[1], 10)
    context_v = contiguous(cache[1], tables[1], 10)
    torch.testing.assert_close(grouped[6], dense_attention(q[6], context_k, context_v))


def grouped_meta(lens: list[int], grouped: bool) -> AttentionMetadata:
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    plan = plan_prefill_groups if grouped else per_sequence_groups
    return AttentionMetadata(
        packed=True,
        slot_mapping=torch.zeros(sum(lens), dtype=torch.int64),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=lens,
        query_lens_cpu=lens,
        prefill_groups=plan(lens, lens, "cpu"),
    )


def test_grouped_prefill_equals_one_sequence_at_a_time() -> None:
    # Short prompts share padded calls; 200 stays alone (padding 7 up to 200 is too costly).
    lens = [7, 5, 6, 200, 1, 7, 3]
    total = sum(lens)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
    cache = random_cache()
    grouped_plan = grouped_meta(lens, grouped=True).prefill_groups
    assert grouped_plan is not None
    assert any(g.gather is not None for g in grouped_plan)
    assert any(g.gather is None for g in grouped_plan)
    grouped = paged_prefill_attention(q, k, v, *cache, grouped_meta(lens, True), SCALE)
    alone = paged_prefill_attention(q, k, v, *cache, grouped_meta(lens, False), SCALE)
    torch.testing.assert_close(grouped, alone)
    start = 0
    for n in lens:  # and each row is its own sequence's causal attention
        last = start + n - 1
        expected = dense_attention(q[last], k[start : last + 1], v[start : last + 1])
        torch.testing.assert_close(grouped[last], expected)
        start += n


def test_long_prompts_are_attended_alone_and_groups_stay_bounded() -> None:
    # Equal lengths would group at any size by the pad ratio; long ones must not.
    long = [MAX_GROUPED_LEN + 1] * 3
    groups = plan_prefill_groups(long, long, "cpu")
    assert groups is not None and len(groups) == 3 and all(g.gather is None for g in groups)
    many = [200] * 64  # 64 x 200**2 would be 2.6M pairs in one group
    groups = plan_prefill_groups(many, many, "cpu")
    assert groups is not None and len(groups) > 1
    assert all(g.num_seqs * g.length**2 <= MAX_GROUP_AREA for g in groups)
