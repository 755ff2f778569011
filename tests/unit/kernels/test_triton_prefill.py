"""The Triton prefill attention kernel against the plain PyTorch prefill attention, run by
Triton's CPU interpreter (float16 and float32: its bfloat16 matrix product is not faithful):
packed sequences that end mid-block, chunks that continue over a cached prefix, single-token
queries, GQA ratios 1 to 8, head dimensions 64 and 128, tiles small enough that a short context
spans many of them; tests/gpu/test_prefill_kernel_gpu.py runs the same on the device."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
pytest.importorskip("triton")

from graphguard.engine.models import DecoderModel, build_model  # noqa: E402
from graphguard.engine.models.attention import AttentionMetadata  # noqa: E402
from graphguard.engine.models.forward import (  # noqa: E402
    PrefillContext,
    prefill_inputs,
    prefill_stages,
)
from graphguard.engine.scheduling.kv import PagedKVStorage  # noqa: E402
from graphguard.kernels import HeadShape, TorchKernels, triton_linear  # noqa: E402
from graphguard.kernels import fused as fused_module  # noqa: E402
from graphguard.kernels import triton_prefill as kernel  # noqa: E402
from graphguard.kernels.fused import TritonKernels  # noqa: E402
from graphguard.segmented import run_eager, split_segments  # noqa: E402
from tests.kernel_cases import rel_error  # noqa: E402
from tests.prefill_cases import PackedPrefill, packed_prefill, reference_attention  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels were imported for the device", allow_module_level=True)

TOLERANCE = {torch.float16: 3e-3, torch.float32: 1e-5}
# GQA ratio 1, 2 (Qwen3-0.6B's heads over fewer of them), 3 (SmolLM2's), 4 and 8
HEADS = {
    "mha": HeadShape(2, 2, 64),
    "gqa2": HeadShape(4, 2, 128),
    "gqa3": HeadShape(6, 2, 64),
    "gqa4": HeadShape(4, 1, 64),
    "gqa8": HeadShape(8, 1, 128),
}
# (new tokens, cached tokens) per sequence: fresh prompts ending mid-block; chunks continuing
# over a cached prefix beside a fresh prompt; single-token queries; one long continued chunk
STEPS = {
    "fresh": ([5, 33, 17], [0, 0, 0]),
    "continued": ([20, 7, 40], [40, 13, 0]),
    "one_token": ([1, 1, 3], [0, 30, 17]),
    "long_chunk": ([60], [100]),
}
# tiles of 8 tokens x the group over keys 16 at a time: short contexts span many of them
SMALL_TILES = kernel.PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


def run(batch: PackedPrefill, scale: float, config=None) -> torch.Tensor:
    meta = batch.meta
    return kernel.prefill_attention(
        batch.q, batch.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        config,
    )  # fmt: skip


def matches_reference(heads: HeadShape, step: tuple[list[int], list[int]], dtype) -> bool:
    batch = packed_prefill(heads, *step, dtype, "cpu")
    scale = heads.head_dim**-0.5
    return rel_error(run(batch, scale), reference_attention(batch, scale)) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_prefill_attention_matches_reference_in_float16(heads, step):
    assert matches_reference(heads, step, torch.float16)


@pytest.mark.parametrize("heads", [HEADS["gqa2"], HEADS["gqa3"]], ids=["gqa2", "gqa3"])
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_prefill_attention_matches_reference_in_float32(heads, step):
    assert matches_reference(heads, step, torch.float32)


@pytest.mark.parametrize("heads", [HEADS["gqa3"], HEADS["gqa8"]], ids=["gqa3", "gqa8"])
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_small_tiles_match_reference(heads, step):
    """Several query tiles per sequence and many key tiles per query tile, each of the tile
    paths (whole, across the diagonal, past a sequence's end) taken many times."""
    batch = packed_prefill(heads, *step, torch.float32, "cpu")
    expected = reference_attention(batch, 0.1)
    assert rel_error(run(batch, 0.1, SMALL_TILES), expected) < 2 * TOLERANCE[torch.float32]


def test_empty_sequences_and_a_wider_table_change_no_row():
    """A step padded for a whole prefill graph (engine/step/model_runner.py): empty sequences
    after the real ones (no query, no context, a table of the dummy block) and tables padded to
    a wider bucket. Their programs exit at once; every real row keeps its bits."""
    heads = HEADS["gqa2"]
    batch = packed_prefill(heads, *STEPS["continued"], torch.float16, "cpu")
    meta = batch.meta
    empty, extra_width = 3, 5
    tables = torch.nn.functional.pad(meta.block_tables, (0, extra_width))  # block 0: unused
    tables = torch.cat([tables, torch.zeros(empty, tables.shape[1], dtype=torch.int32)])
    lens = torch.cat([meta.seq_lens, torch.zeros(empty, dtype=torch.int32)])
    ends = meta.query_start_loc[-1:].expand(empty)
    starts = torch.cat([meta.query_start_loc, ends])
    padded = kernel.prefill_attention(batch.q, batch.kv_cache, starts, lens, tables, 0.1)
    assert torch.equal(padded, run(batch, 0.1))


@pytest.mark.parametrize("heads", [HEADS["gqa2"], HEADS["gqa8"]], ids=["gqa2", "gqa8"])
def test_the_tiles_for_a_small_grid_match_reference(heads):
    """SMALL_CONFIGS, for a short chunk over a long context: 16 rows a program."""
    batch = packed_prefill(heads, [20, 1], [130, 7], torch.float16, "cpu")
    expected = reference_attention(batch, 0.1)
    small = kernel.SMALL_CONFIGS[heads.head_dim]
    assert rel_error(run(batch, 0.1, small), expected) < 2 * TOLERANCE[torch.float16]


def test_is_causal_over_the_cached_prefix():
    """Query i of a chunk after c cached tokens sees keys 0..c+i: changing a later key leaves
    every earlier query's output as it was."""
    batch = packed_prefill(HEADS["gqa2"], [24], [40], torch.float32, "cpu")
    before = run(batch, 0.1, SMALL_TILES)
    k_cache, v_cache = batch.kv_cache
    slot = batch.meta.slot_mapping[10].item()  # the chunk's 11th token: position 50
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[slot] += 1.0
    after = run(batch, 0.1, SMALL_TILES)
    assert torch.equal(after[:10], before[:10])
    assert not torch.equal(after[10], before[10])


def test_never_reads_slots_past_a_sequences_length():
    """Slots of a sequence's blocks past its length (and unused blocks) may hold anything, NaN
    included: the output is the reference's all the same."""
    batch = packed_prefill(HEADS["gqa3"], [5, 20, 1], [0, 9, 30], torch.float32, "cpu")
    expected = reference_attention(batch, 0.1)
    live = torch.zeros(batch.kv_cache[0].shape[:2], dtype=torch.bool)
    tables, lens = batch.meta.block_tables.long(), batch.meta.seq_lens_cpu or []
    for table, seq_len in zip(tables, lens, strict=True):
        positions = torch.arange(seq_len)
        live[table[positions // live.shape[1]], positions % live.shape[1]] = True
    for cache in batch.kv_cache:
        cache[~live] = float("nan")
    assert rel_error(run(batch, 0.1, SMALL_TILES), expected) < 2 * TOLERANCE[torch.float32]


def test_two_calls_are_bitwise_equal_and_a_sequence_ignores_its_neighbours():
    batch = packed_prefill(HEADS["gqa2"], [30, 9, 17], [5, 0, 40], torch.float16, "cpu")
    first, second = run(batch, 0.1), run(batch, 0.1)
    assert torch.equal(first, second)
    meta = batch.meta  # the first sequence alone: its rows, its table row, its lengths
    alone = kernel.prefill_attention(
        batch.q[:30], batch.kv_cache, meta.query_start_loc[:2], meta.seq_lens[:1],
        meta.block_tables[:1], 0.1,
    )  # fmt: skip
    assert torch.equal(alone, first[:30])


def test_the_reference_set_runs_the_plain_pytorch_attention():
    batch = packed_prefill(HEADS["gqa3"], [6, 11], [0, 21], torch.float32, "cpu")
    k, v = batch.new_kv()
    out = TorchKernels().prefill_attention(batch.q, k, v, batch.kv_cache, batch.meta, 0.1)
    assert torch.equal(out, reference_attention(batch, 0.1))


def test_small_tiles_are_taken_only_where_large_ones_would_idle_most_of_the_device():
    def shape(num_tokens: int, head_dim: int = 128) -> kernel.PrefillShape:
        return kernel.PrefillShape(num_tokens, 1, 8, 2, head_dim)  # Qwen3-0.6B's heads

    # 50 tokens are one tile of 64 for each of 8 KV heads: 8 programs for 132 multiprocessors
    assert kernel.pick_config(shape(50), num_sms=132) == kernel.SMALL_CONFIGS[128]
    assert kernel.pick_config(shape(4096), num_sms=132) == kernel.CONFIGS[128]
    assert kernel.pick_config(shape(50), num_sms=0) == kernel.CONFIGS[128]  # not a GPU
    assert kernel.pick_config(shape(50, head_dim=32)) == kernel.CONFIGS[64]


def test_refuses_a_head_dim_that_is_not_a_power_of_two():
    batch = packed_prefill(HeadShape(2, 2, 96), [4], [0], torch.float32, "cpu")
    with pytest.raises(ValueError, match="head_dim"):
        run(batch, 0.1)


class CountingTritonKernels(TritonKernels):
    """The Triton set, counting the prefill attention calls the model makes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.num_prefill_calls = 0

    def prefill_attention(self, *args):
        self.num_prefill_calls += 1
        return super().prefill_attention(*args)


def model_step(
    model: DecoderModel, kv: PagedKVStorage, step: list[tuple[int, int, int]], staged: bool | str
) -> torch.Tensor:
    """Hidden states of one packed prefill step of (table row, cached, new tokens) sequences,
    with no prefill groups planned (as the model runner leaves them for the Triton set); the
    model's layers, or the prefill stages the segment graphs run."""
    size, width = kv.block_size, 4
    tables = torch.arange(1, 1 + 2 * width, dtype=torch.int32).view(2, width)
    positions = [p for _, first, n in step for p in range(first, first + n)]
    rows = [row for row, _, n in step for _ in range(n)]
    tokens = list(zip(rows, positions, strict=True))
    slots = [int(tables[r, p // size]) * size + p % size for r, p in tokens]
    meta = AttentionMetadata(
        packed=True,
        slot_mapping=torch.tensor(slots),
        block_tables=tables[[row for row, _, _ in step]],
        seq_lens=torch.tensor([first + n for _, first, n in step], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *[n for *_, n in step]]).cumsum(0).int(),
        seq_lens_cpu=[first + n for _, first, n in step],
        query_lens_cpu=[n for *_, n in step],
    )
    ids = torch.tensor([(7 * p + r) % 97 for r, p in tokens])
    pos = torch.tensor(positions)
    if not staged:
        return model(ids, pos, meta, kv)
    whole = staged == "whole"  # the pipeline's whole form, else its segments'
    carry = prefill_inputs(model, ids, pos, None, meta, whole=whole)
    pieces = split_segments(prefill_stages(model, kv, whole=whole))
    return run_eager(pieces, carry, PrefillContext(meta, kv))[0]


def model_and_cache(config, kernels: TorchKernels) -> tuple[DecoderModel, PagedKVStorage]:
    """The tiny model (the same weights every call) on `kernels`, and an empty cache for it."""
    model = build_model(config, dtype=torch.float32, device="cpu", seed=0)
    model.use_kernels(kernels)
    kv = PagedKVStorage(
        num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=16,
        num_blocks=9, block_size=16, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    return model, kv


@pytest.mark.parametrize("staged", [False, True], ids=["layers", "stages"])
def test_the_model_prefills_through_the_kernel_sets_attention(staged):
    """A chunked prefill (a prompt's first 25 tokens, then its next 15 beside a fresh prompt of
    9) through the Triton set's kernels gives the reference set's hidden states, every layer's
    attention taken from the set."""
    config = tiny_config(head_dim=16)
    fused = CountingTritonKernels()
    outputs = []
    for kernels in (TorchKernels(), fused):
        model, kv = model_and_cache(config, kernels)
        first = model_step(model, kv, [(0, 0, 25)], staged)
        outputs.append((first, model_step(model, kv, [(0, 25, 15), (1, 0, 9)], staged)))
    (ref_first, ref_second), (first, second) = outputs
    assert rel_error(first, ref_first) < 1e-4 and rel_error(second, ref_second) < 1e-4
    assert fused.num_prefill_calls == 2 * config.num_layers


def test_the_fused_sets_whole_pipeline_is_one_segment_and_gives_the_layers_states():
    """The fused set's attention reads only the carry's tensors, so the pipeline's whole form
    has no eager stage: one segment, one graph per packed prefill (engine/models/forward.py),
    where the segments' form has an eager attention stage between two segments a layer. The
    reference set, whose attention needs host-side lengths, has no whole form."""
    config = tiny_config(head_dim=16)
    model, kv = model_and_cache(config, TritonKernels())
    whole = split_segments(prefill_stages(model, kv, whole=True))
    assert len(whole) == 1 and len(split_segments(prefill_stages(model, kv))) == 2 * 2 + 1
    step = [(0, 0, 25)]
    assert torch.equal(model_step(model, kv, step, "whole"), model_step(model, kv, step, False))
    with pytest.raises(ValueError, match="host-side lengths"):
        prefill_stages(*model_and_cache(config, TorchKernels()), whole=True)


def test_the_environment_can_keep_the_fused_sets_prefill_in_segments(monkeypatch):
    """GRAPHGUARD_WHOLE_PREFILL=0 (side-by-side runs): no whole form, and the startup line
    names the switch."""
    monkeypatch.setenv(fused_module.WHOLE_PREFILL_ENV, "0")
    kernels = TritonKernels()
    assert not kernels.whole_prefill_graphs
    assert kernels.opt_ins() == ("GRAPHGUARD_WHOLE_PREFILL=0",)


def test_with_gemm_prologues_a_few_rows_step_norms_and_activates_inside_its_gemms(monkeypatch):
    """GRAPHGUARD_GEMM_PROLOGUES=1: a step of 9 tokens (few rows) runs each layer's two norms
    and its SiLU inside the GEMMs they feed, and gives the reference set's hidden states."""
    monkeypatch.setenv(fused_module.PROLOGUES_ENV, "1")
    calls: list[str] = []
    for name in ("few_rows_norm_linear", "few_rows_silu_linear"):
        real = getattr(triton_linear, name)
        monkeypatch.setattr(triton_linear, name, spy(real, name, calls))
    config = tiny_config(head_dim=16)
    outputs = []
    for kernels in (TorchKernels(), TritonKernels()):
        outputs.append(model_step(*model_and_cache(config, kernels), [(0, 0, 9)], staged=False))
    assert rel_error(outputs[1], outputs[0]) < 1e-4
    norms, silus = calls.count("few_rows_norm_linear"), calls.count("few_rows_silu_linear")
    assert (norms, silus) == (2 * config.num_layers, config.num_layers)


def test_with_split_k_a_few_rows_step_splits_the_gemms_of_few_outputs(monkeypatch):
    """GRAPHGUARD_SPLIT_K=1: a step of 9 tokens splits K in the GEMMs whose column blocks are
    few (o_proj and down_proj at a width of 32 and 256 inputs), the startup line names the
    switch, and the hidden states stay the reference set's."""
    monkeypatch.setenv(fused_module.SPLIT_K_ENV, "1")
    monkeypatch.delenv(fused_module.WHOLE_PREFILL_ENV, raising=False)
    real = triton_linear.few_rows_linear
    splits: list[int] = []

    def recorded(x, weight, plan=None):
        splits.append(plan.splits if plan is not None else 1)
        return real(x, weight, plan)

    monkeypatch.setattr(triton_linear, "few_rows_linear", recorded)
    config = tiny_config(head_dim=16, num_heads=16, intermediate_size=256)
    kernels = TritonKernels()
    assert kernels.opt_ins() == (f"{fused_module.SPLIT_K_ENV}=1",)
    outputs = [
        model_step(*model_and_cache(config, k), [(0, 0, 9)], staged=False)
        for k in (TorchKernels(), kernels)
    ]
    assert rel_error(outputs[1], outputs[0]) < 1e-4
    # per layer: q/k/v and gate/up whole (320 x 32 and 512 x 32), o_proj (32 x 256) and down
    # (32 x 256) split in two
    assert splits == [1, 2, 1, 2] * config.num_layers, splits


def spy(fn, name: str, calls: list[str]):
    def called(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return called


@pytest.mark.parametrize("one_row", ["1", "0"])
def test_a_step_of_one_row_runs_its_gemms_in_the_one_row_kernel(monkeypatch, one_row):
    """A step of one token runs each layer's four GEMMs in `one_row_linear`, a step of two in
    the few-rows kernel; GRAPHGUARD_ONE_ROW=0 (side-by-side runs) sends the one row to the
    few-rows kernel too, and the startup line names it. The hidden states are the reference
    set's either way."""
    monkeypatch.setenv(fused_module.ONE_ROW_ENV, one_row)
    calls: list[str] = []
    for name in ("one_row_linear", "few_rows_linear"):
        real = getattr(triton_linear, name)
        monkeypatch.setattr(triton_linear, name, spy(real, name, calls))
    config = tiny_config(head_dim=16)
    kernels = TritonKernels()
    assert kernels.opt_ins() == (() if one_row == "1" else ("GRAPHGUARD_ONE_ROW=0",))
    taken = {}
    for tokens in (1, 2):
        calls.clear()
        outputs = [
            model_step(*model_and_cache(config, k), [(0, 0, tokens)], staged=False)
            for k in (TorchKernels(), kernels)
        ]
        assert rel_error(outputs[1], outputs[0]) < 1e-4
        taken[tokens] = set(calls), len(calls)
    gemms = 4 * config.num_layers
    one = "one_row_linear" if one_row == "1" else "few_rows_linear"
    assert taken == {1: ({one}, gemms), 2: ({"few_rows_linear"}, gemms)}
