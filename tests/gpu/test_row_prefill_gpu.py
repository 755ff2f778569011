"""A short prefill run as rows (each token a row of the Triton decode attention over its
sequence's paged context, graphguard/engine/models/forward.py `prefills_as_rows`) on a real CUDA
device: it gives the hidden states of the grouped SDPA prefill, fresh prompts and a chunk that
continues over its cached context alike, and the engine runs waves of short prompts as rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphguard.engine.models.attention import AttentionMetadata, plan_prefill_groups
from graphguard.engine.models.forward import row_meta
from graphguard.engine.tokens.sampling import SamplingParams
from tests.gpu.test_engine_gpu import loaded, make  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

pytestmark = pytest.mark.gpu


def metas(lens: list[int], cached: list[int], tables: list[list[int]], block_size: int):
    """(grouped metadata, rows metadata, positions) of a prefill of sequences of `lens`
    tokens whose first `cached` are in the cache already, in blocks `tables`."""
    positions: list[int] = []
    slots: list[int] = []
    row_tables: list[list[int]] = []
    for table, n, first in zip(tables, lens, cached, strict=True):
        for pos in range(first, n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            row_tables.append(table)
    query_lens = [n - c for n, c in zip(lens, cached, strict=True)]

    def ints(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device="cuda")

    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    grouped = AttentionMetadata(
        packed=True,
        slot_mapping=ints(slots, torch.int64),
        block_tables=ints(tables),
        seq_lens=ints(lens),
        query_start_loc=ints(starts),
        seq_lens_cpu=lens,
        query_lens_cpu=query_lens,
        prefill_groups=plan_prefill_groups(query_lens, lens, "cuda"),
    )
    rows = row_meta(ints(slots, torch.int64), ints(row_tables), ints([p + 1 for p in positions]))
    return grouped, rows, ints(positions, torch.int64)


def test_rows_give_the_grouped_prefills_hidden_states(loaded):  # noqa: F811
    engine = make(loaded, enforce_eager=True)
    try:
        forward, block_size = engine.forward, engine.kv.block_size
        assert loaded.model.kernels.row_prefill_area > 0  # the Triton set
        lens = [9, 40, 70, 5]
        width = -(-max(lens) // block_size)
        tables = [[1 + i * width + b for b in range(width)] for i in range(len(lens))]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 40000, (n,), generator=g).cuda() for n in lens]
        # fresh prompts; then, their K/V cached, the 70-token prompt's last 20 tokens again as
        # a chunk that continues over its first 50
        calls = [(lens, [0] * len(lens), tables, torch.cat(prompts))]
        calls.append(([70], [50], tables[2:3], prompts[2][50:]))
        for seq_lens, cached, blocks, ids in calls:
            grouped, rows, positions = metas(seq_lens, cached, blocks, block_size)
            expected = forward.prefill(ids, positions, grouped, None).float()
            actual = forward.prefill(ids, positions, rows, None).float()
            similarity = F.cosine_similarity(actual, expected, dim=-1)
            assert similarity.min() > 0.999, (cached, similarity.min())
    finally:
        engine.shutdown()


def test_waves_of_short_prompts_prefill_as_rows_through_whole_graphs(loaded):  # noqa: F811
    engine = make(loaded, warmup_graphs=True)
    try:
        before = engine.graphs.stats()["prefill"]
        assert before["rows"]["captures"] > 0 and before["captures"] == 0
        for index in range(12):
            prompt = list(range(100 + index, 100 + index + 5 + index))
            engine.add_request(str(index), prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        after = engine.graphs.stats()["prefill"]
        assert after["rows"]["replays"] > before["rows"]["replays"]
        assert after["rows"]["fallbacks"] == {} and after["calls"] == 0
    finally:
        engine.shutdown()
