"""Short prefills run as rows: each token one row of decode attention over its sequence's paged
context up to its own position (graphguard/engine/models/forward.py `prefills_as_rows`), eagerly and
as whole graphs keyed by (token bucket, width bucket) (graphguard/engine/graphs/runners.py).

The reference kernel set runs no prefill as rows (its decode attention gathers every row's
whole context); these tests turn rows on for it, as the Triton set has them on."""

from __future__ import annotations

import pytest
import torch

from graphguard.core.admission import AdmissionConfig
from graphguard.engine.config import GraphConfig
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.shapes import (
    ROW_PREFILL_TOKENS,
    continued_prefill_group,
    prefills_as_rows,
    row_widths,
)
from graphguard.engine.step import model_runner
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.kernels.reference import TorchKernels
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion, token_ids_of
from tests.unit.engine.test_background_capture import tiny  # noqa: F401

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], list(range(20, 45)), list(range(50, 53))]
# chunks of 16 tokens: the 25-token prompt's second chunk continues over its cached first one
CHUNKED = {"max_num_batched_tokens": 16}


ROWS_AREA = 512 * 2048  # the Triton set's
# a prefill key is captured at its first call, inside the step
EARN_AT_ONCE = GraphConfig(background_capture=False, prefill_admission=AdmissionConfig(min_hits=1))


@pytest.fixture
def rows_on(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Rows on for the reference set; the model runner's decisions, in order."""
    monkeypatch.setattr(TorchKernels, "row_prefill_area", ROWS_AREA)
    return decisions(monkeypatch)


def decisions(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The model runner's decisions whether a prefill runs as rows, in order."""
    made: list[bool] = []

    def deciding(kernels, num_tokens, longest):
        made.append(prefills_as_rows(kernels, num_tokens, longest))
        return made[-1]

    monkeypatch.setattr(model_runner, "prefills_as_rows", deciding)
    return made


def generate(loaded: LoadedModel, **overrides) -> dict[str, list[int]]:
    engine = make_engine(loaded, **overrides)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(str(index), prompt, params)
        outputs = run_to_completion(engine)
        return {rid: token_ids_of(outs) for rid, outs in outputs.items()}
    finally:
        engine.shutdown()


def test_the_decision_bounds_tokens_and_area() -> None:
    kernels = TorchKernels()
    assert not prefills_as_rows(kernels, 16, 16)  # the reference set: never
    kernels.row_prefill_area = 512 * 2048
    assert prefills_as_rows(kernels, 16, 16)
    assert prefills_as_rows(kernels, 512, 2048)
    assert not prefills_as_rows(kernels, 512, 2049)  # rows x context
    assert prefills_as_rows(kernels, ROW_PREFILL_TOKENS, 512)
    assert not prefills_as_rows(kernels, 2 * ROW_PREFILL_TOKENS, 16)  # too many rows


def test_prefills_run_as_rows_give_the_grouped_prefills_tokens(tiny, monkeypatch):  # noqa: F811
    made = decisions(monkeypatch)
    grouped = generate(tiny, enforce_eager=True, **CHUNKED)
    assert made and not any(made)  # the reference set: grouped SDPA
    made.clear()
    monkeypatch.setattr(TorchKernels, "row_prefill_area", ROWS_AREA)
    rows = generate(tiny, enforce_eager=True, **CHUNKED)
    # every prefill is short here: each ran as rows, the 25-token prompt's second chunk too
    assert made and all(made)
    assert rows == grouped


def test_rows_prefill_graphs_are_captured_by_bucket_and_replayed(tiny, rows_on):  # noqa: F811
    eager = generate(tiny, enforce_eager=True)
    # NOTE: without prefix caching, so that the second wave prefills its whole prompts again
    engine = make_engine(tiny, graph_backend="sim", graphs=EARN_AT_ONCE, prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
        got: dict[str, list[int]] = {}
        for wave in range(2):  # the second wave replays the first one's rows keys
            for index, prompt in enumerate(PROMPTS):
                engine.add_request(f"{wave}-{index}", prompt, params)
            outputs = run_to_completion(engine)
            got.update({rid: token_ids_of(outs) for rid, outs in outputs.items()})
        rows = engine.graphs.stats()["prefill"]["rows"]
        assert rows["replays"] >= 1 and rows["captures"] >= 1
        keys = engine.graphs.prefill_rows.admitted_keys()
        assert len(rows["graphs"]) == len(keys) >= 1
        for key in keys:  # a token bucket (38 tokens: 64), the narrowest width bucket
            assert key.args[0].shape == (64,) and key.args[2].shape == (64, 8)
        # padding rows wrote only the dummy block: every request's tokens are the eager ones
        for rid, tokens in got.items():
            assert tokens == eager[rid.split("-")[1]]
        assert engine.graphs.stats()["prefill"]["captures"] == 0  # no segmented group
    finally:
        engine.shutdown()


def test_reload_and_shutdown_retire_rows_graphs(tiny, rows_on):  # noqa: F811
    engine = make_engine(tiny, graph_backend="sim", graphs=EARN_AT_ONCE)
    rows = engine.graphs.prefill_rows
    assert rows is not None
    engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2))
    run_to_completion(engine)
    assert len(rows.entries()) == 1
    engine.reload_weights(tiny.model.state_dict())
    assert rows.entries() == []
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2))
    run_to_completion(engine)
    assert len(rows.entries()) == 1
    engine.shutdown()
    assert rows.entries() == []
    assert engine.kv.num_used_blocks == 0


def test_padding_rows_write_only_the_dummy_block(tiny, rows_on):  # noqa: F811
    # graphs on but never admitted: the prefill runs eagerly, padded to its token bucket
    engine = make_engine(
        tiny,
        graph_backend="sim",
        graphs=GraphConfig(prefill_admission=AdmissionConfig(min_hits=10**6)),
    )
    try:
        dummy = PagedKVStorage.DUMMY_BLOCK
        before = [cache.clone() for cache in engine.kv.k_cache]
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
        run_to_completion(engine)
        assert rows_on == [True]
        written = {
            block
            for layer, cache in enumerate(engine.kv.k_cache)
            for block in range(cache.shape[0])
            if not torch.equal(cache[block], before[layer][block])
        }
        # the prompt's one block, and the dummy block that its 13 padding rows wrote
        assert dummy in written and len(written) == 2
    finally:
        engine.shutdown()


def test_a_warm_start_captures_each_token_bucket_at_every_width_it_can_run_as_rows(
    tiny,  # noqa: F811
    rows_on,
):
    # 4-token blocks, 64-token sequences: width buckets 8 and 16 blocks. A prompt of 32
    # tokens needs only 8, but 32 tokens that continue a cached context of 40 need 16
    engine = make_engine(tiny, graph_backend="sim", warmup_graphs=True)
    try:
        keys = engine.graphs.prefill_rows.admitted_keys()
        shapes = sorted(tuple(key.args[2].shape) for key in keys)
        assert shapes == [(rows, width) for rows in (16, 32, 64, 128, 256) for width in (8, 16)]
        assert engine.graphs.stats()["prefill"]["captures"] == 0  # every bucket runs as rows
        assert engine.kv.num_used_blocks == 0
    finally:
        engine.shutdown()


class RowsKernels(TorchKernels):
    row_prefill_area = ROWS_AREA


WIDTHS = [8 << i for i in range(10)]  # 8 to 4,096 blocks of 16 tokens: up to 64k tokens


@pytest.mark.parametrize(
    "tokens,widest",
    [(32, 2048), (256, 256), (512, 128), (2048, 32)],  # 32k, 4k, 2k and 512-token contexts
)
def test_a_prefill_runs_as_rows_at_every_width_whose_shortest_context_stays_in_the_area(
    tokens, widest
):
    found = row_widths(RowsKernels(), 16, tokens, WIDTHS)
    assert found == [width for width in WIDTHS if width <= widest]
    # each width taken: some context needing it runs as rows; the next: none does
    shortest = (widest // 2) * 16 + 1 if widest > 8 else 1
    assert prefills_as_rows(RowsKernels(), tokens, shortest)
    assert not prefills_as_rows(RowsKernels(), tokens, widest * 16 + 1)
    assert row_widths(TorchKernels(), 16, tokens, WIDTHS) == []  # area 0: never as rows


def test_a_start_captures_the_512_token_group_only_where_contexts_keep_it_from_rows():
    kernels = RowsKernels()
    # 512 tokens run as rows up to 2,048-token contexts (width 128): no group below that
    assert continued_prefill_group(kernels, 16, WIDTHS[:5], 8192) is None
    assert continued_prefill_group(kernels, 16, WIDTHS[:6], 8192) == 512
    assert continued_prefill_group(kernels, 16, WIDTHS, 256) is None  # no step holds 512
    assert continued_prefill_group(TorchKernels(), 16, WIDTHS, 8192) is None


def test_a_lazy_start_prices_the_rows_runner(tiny, rows_on):  # noqa: F811
    engine = make_engine(tiny, graph_backend="sim", price_captures=True)
    try:
        rows = engine.graphs.prefill_rows
        # the ladder of row buckets a pad factor of 4 apart, from the largest (this engine's
        # step budget, 256 tokens) down, at each table width they run as rows at: 256
        # answers packed prefills of 64 to 256 tokens, 32 those of 16 and 32, whether over a
        # context of 8 blocks or 16 (a short chunk that continues a cached context)
        shapes = sorted(tuple(key.args[2].shape) for key in rows.admitted_keys())
        assert shapes == [(32, 8), (32, 16), (256, 8), (256, 16)]
        assert rows.policy.knows_a_price
    finally:
        engine.shutdown()


def test_a_lazy_starts_short_prefills_ride_the_priced_rows_graphs(tiny, rows_on):  # noqa: F811
    eager = make_engine(tiny, enforce_eager=True, max_num_seqs=8)
    engine = make_engine(tiny, graph_backend="sim", price_captures=True, max_num_seqs=8)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3)
        expected: dict[str, list[int]] = {}
        got: dict[str, list[int]] = {}
        for target, tokens in ((eager, expected), (engine, got)):
            for i in range(8):  # 8 prompts of 9 tokens: 72 packed, a 128-token bucket
                target.add_request(f"r{i}", list(range(100 + i, 109 + i)), params)
            waves = run_to_completion(target)
            target.add_request("late", list(range(200, 209)), params)  # 9 tokens: bucket 16
            waves.update(run_to_completion(target))
            tokens.update({rid: token_ids_of(outs) for rid, outs in waves.items()})
        assert got == expected and len(got) == 9
        rows = engine.graphs.stats()["prefill"]["rows"]
        # the wave rode the 256-token graph, the late prompt the 32-token one
        assert (rows["replays"], rows["covered"], rows["fallbacks"]) == (2, 2, {})
        # the ladder (256 and 32 tokens, each at two widths), taken at start; none since
        assert rows["captures"] == 4
    finally:
        eager.shutdown()
        engine.shutdown()


def test_a_warm_start_captures_the_largest_row_bucket_for_short_prompts(tiny, rows_on):  # noqa: F811
    # 2,048 tokens run as rows when the prompts are short (tokens x longest context within
    # the row area), not as one prompt: its keys are those of contexts up to 512 tokens
    settings = {"max_num_batched_tokens": 2048, "max_model_len": 512, "block_size": 16}
    engine = make_engine(tiny, graph_backend="sim", warmup_graphs=True, **settings)
    try:
        shapes = {tuple(key.args[2].shape) for key in engine.graphs.prefill_rows.admitted_keys()}
        assert {(2048, 8), (2048, 16), (2048, 32), (1024, 32), (16, 8)} <= shapes
        # every bucket at every width: 2,048 tokens over a 257-token context stay in the area
        assert len(shapes) == 8 * 3
        assert engine.graphs.stats()["prefill"]["captures"] == 0
    finally:
        engine.shutdown()


def test_prompt_logprobs_and_token_logprobs_match_the_grouped_prefills(tiny, monkeypatch):  # noqa: F811
    # prompt logprobs come from the hidden rows of each prefill chunk: as rows, the padding
    # rows sit after the real ones, and the chunked prompt scores its two chunks in order
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=2)

    def scored() -> dict[str, tuple[list, list]]:
        engine = make_engine(tiny, graph_backend="sim", **CHUNKED)  # padded to token buckets
        try:
            for index, prompt in enumerate(PROMPTS):
                engine.add_request(str(index), prompt, params)
            outputs = run_to_completion(engine)
        finally:
            engine.shutdown()
        result = {}
        for rid, outs in outputs.items():
            prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
            tokens = [lp for o in outs for lp in o.logprobs or []]
            result[rid] = (prompt, tokens)
        return result

    grouped = scored()
    monkeypatch.setattr(TorchKernels, "row_prefill_area", ROWS_AREA)
    made = decisions(monkeypatch)
    rows = scored()
    assert made and all(made)
    assert rows.keys() == grouped.keys()
    for rid, (prompt, tokens) in rows.items():
        expected_prompt, expected_tokens = grouped[rid]
        assert len(prompt) == len(PROMPTS[int(rid)]) and prompt[0] is None
        for got, want in zip(
            prompt[1:] + tokens, expected_prompt[1:] + expected_tokens, strict=True
        ):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
