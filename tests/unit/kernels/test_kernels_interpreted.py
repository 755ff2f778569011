"""The fused Triton kernels against the reference set, run by Triton's CPU interpreter.

The interpreter runs the kernels' own code on the CPU (float16 and float32: its bfloat16
matrix product is not faithful), so CI checks their indexing, masking and split merging
without a GPU; tests/gpu/test_kernels_gpu.py checks bfloat16 and speed on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
pytest.importorskip("triton")

from graphguard.kernels import (  # noqa: E402
    launch,
    triton_decode,
    triton_linear,
    triton_mlp,
    triton_norm,
    triton_rope,
)
from tests.kernel_cases import (  # noqa: E402
    HEADS,
    REFERENCE,
    float_norm,
    paged_batch,
    qk_norm,
    rel_error,
    rope_tables,
)

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels were imported for the device", allow_module_level=True)

DTYPES = (torch.float16, torch.float32)
TOLERANCE = {torch.float16: 3e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,hidden", [(1, 576), (7, 1024), (3, 100)])
def test_add_rms_norm_matches_reference(dtype, num_rows, hidden):
    x, residual = torch.randn(2, num_rows, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    out, summed = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_sum = REFERENCE.add_rms_norm(x.float(), residual.float(), weight.float(), 1e-6)
    assert rel_error(summed, ref_sum) < TOLERANCE[dtype]
    assert rel_error(out, ref_out) < 2 * TOLERANCE[dtype]
    plain = triton_norm.rms_norm(x, weight, 1e-6)
    assert rel_error(plain, REFERENCE.rms_norm(x.float(), weight.float(), 1e-6)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,outs,ins", [(1, 96, 576), (3, 50, 100), (16, 40, 130)])
def test_few_rows_linear_matches_reference(dtype, rows, outs, ins):
    x = torch.randn(rows, ins).to(dtype)
    weight = (torch.randn(outs, ins) / ins**0.5).to(dtype)
    expected = REFERENCE.linear(x.float(), weight.float())
    assert rel_error(triton_linear.few_rows_linear(x, weight), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_a_split_k_linear_matches_the_reference_and_leaves_its_counters_at_zero(rows):
    x = torch.randn(rows, 1024).half()
    weight = (torch.randn(64, 1024) / 32).half()
    plan = triton_linear.LinearPlan(splits=4, block_k=128)
    out = triton_linear.few_rows_linear(x, weight, plan)
    assert rel_error(out, REFERENCE.linear(x.float(), weight.float())) < TOLERANCE[torch.float16]
    assert torch.equal(out[:1], triton_linear.few_rows_linear(x[:1], weight, plan))
    assert not triton_linear.arrival_counters(torch.device("cpu")).any()
    assert triton_linear.plan_linear(1024, 64).splits == 1  # the engine's plans do not split
    assert triton_linear.plan_linear(1024, 64, split=True).splits == 8


def test_few_rows_linear_gives_a_row_the_same_bits_in_any_batch():
    x = torch.randn(16, 200).half()
    weight = torch.randn(64, 200).half()
    together = triton_linear.few_rows_linear(x, weight)
    assert torch.equal(together[:1], triton_linear.few_rows_linear(x[:1], weight))


@pytest.mark.parametrize(
    "rows,outs,ins,splits", [(1, 96, 576, 1), (3, 50, 100, 1), (16, 40, 130, 1), (5, 64, 1024, 4)]
)
def test_a_dependent_launchs_linear_gives_the_plain_launchs_bits(
    monkeypatch, rows, outs, ins, splits
):
    # NOTE: the interpreter has no griddepcontrol: PDL here runs only the code around it (the
    # first weight tile loaded ahead, graphguard/kernels/launch.py); the device runs the rest.
    x = torch.randn(rows, ins).half()
    weight = (torch.randn(outs, ins) / ins**0.5).half()
    plan = triton_linear.LinearPlan(splits=splits)
    plain = triton_linear.few_rows_linear(x, weight, plan)
    monkeypatch.setattr(launch, "dependent_launch", lambda device: True)
    assert torch.equal(triton_linear.few_rows_linear(x, weight, plan), plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,outs,inter", [(1, 96, 200), (5, 40, 128), (16, 24, 300)])
@pytest.mark.parametrize("pdl", [False, True])
def test_silu_into_the_linear_gives_silu_mul_then_the_linears_bits(
    monkeypatch, dtype, rows, outs, inter, pdl
):
    gate_up = torch.randn(rows, 2 * inter).to(dtype)
    weight = (torch.randn(outs, inter) / inter**0.5).to(dtype)
    unfused = triton_linear.few_rows_linear(triton_mlp.silu_mul(gate_up), weight)
    monkeypatch.setattr(launch, "dependent_launch", lambda device: pdl)
    assert torch.equal(triton_linear.few_rows_silu_linear(gate_up, weight), unfused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,outs,hidden", [(1, 96, 576), (5, 40, 100), (16, 64, 1024)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_norm_into_the_linear_matches_the_norm_then_the_linear(
    dtype, rows, outs, hidden, with_residual
):
    x, residual = torch.randn(2, rows, hidden).to(dtype)
    gamma = (torch.rand(hidden) + 0.5).to(dtype)
    weight = (torch.randn(outs, hidden) / hidden**0.5).to(dtype)
    if with_residual:
        normed, summed = triton_norm.add_rms_norm(x, residual, gamma, 1e-6)
    else:
        normed, summed = triton_norm.rms_norm(x, gamma, 1e-6), x
    unfused = triton_linear.few_rows_linear(normed, weight)
    out, fused_sum = triton_linear.few_rows_norm_linear(
        x, residual if with_residual else None, gamma, 1e-6, weight
    )
    assert torch.equal(fused_sum, summed)  # the residual sum rounds as the norm kernel's
    # NOTE: the RMS sums the row in K tiles, the norm kernel in one reduction: an ulp apart
    assert rel_error(out, unfused) < TOLERANCE[dtype]
    reference = REFERENCE.linear(REFERENCE.rms_norm(summed.float(), gamma.float(), 1e-6),
                                 weight.float())  # fmt: skip
    assert rel_error(out, reference) < 2 * TOLERANCE[dtype]


def test_a_split_norm_linear_matches_the_unsplit_one():
    x, residual = torch.randn(2, 3, 1024).half()
    gamma = (torch.rand(1024) + 0.5).half()
    weight = (torch.randn(64, 1024) / 32).half()
    plain = triton_linear.few_rows_norm_linear(x, residual, gamma, 1e-6, weight)
    split = triton_linear.few_rows_norm_linear(
        x, residual, gamma, 1e-6, weight, triton_linear.LinearPlan(splits=4)
    )
    assert torch.equal(split[1], plain[1])
    assert rel_error(split[0], plain[0]) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    gate_up = torch.randn(5, 2 * 1500).to(dtype)  # a width that is not a whole block
    expected = REFERENCE.silu_mul(gate_up.float())
    assert rel_error(triton_mlp.silu_mul(gate_up), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["smollm2", "qwen3"])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_and_cache_write_match_reference(dtype, heads, with_norm):
    num_tokens = 5
    width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    qkv = torch.randn(num_tokens, width).to(dtype)
    cos, sin = rope_tables(num_tokens, heads.head_dim, dtype, "cpu")
    norm = qk_norm(heads, dtype, "cpu") if with_norm else None
    expected = REFERENCE.rope_qkv(qkv.float(), cos.float(), sin.float(), heads, float_norm(norm))
    for actual, ref in zip(triton_rope.rope_qkv(qkv, cos, sin, heads, norm), expected, strict=True):
        assert rel_error(actual, ref) < 2 * TOLERANCE[dtype]
    shape = (4, 16, heads.num_kv_heads, heads.head_dim)
    cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    slots = torch.tensor([3, 17, 40, 41, 63])
    q = triton_rope.rope_qkv_write(qkv, cos, sin, heads, norm, cache, slots)
    assert rel_error(q, expected[0]) < 2 * TOLERANCE[dtype]
    flat_k, flat_v = (c.view(-1, heads.num_kv_heads, heads.head_dim) for c in cache)
    assert rel_error(flat_k[slots], expected[1]) < 2 * TOLERANCE[dtype]
    assert torch.equal(flat_v[slots], expected[2].to(dtype))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


# (lens, width): one block, mid-block ends, a split plan with several splits, a padding row
# (the plan itself: tests/unit/kernels/test_decode_split_plan.py)
DECODE_CASES = [([1], 1), ([5, 16, 17], 2), ([1, 100, 250, 300], 32), ([0, 40], 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["smollm2", "qwen3"])
@pytest.mark.parametrize("lens,width", DECODE_CASES)
def test_decode_attention_matches_reference(dtype, heads, lens, width):
    q, cache, tables, seq_lens = paged_batch(heads, lens, width, dtype, "cpu")
    scale = heads.head_dim**-0.5
    actual = triton_decode.decode_attention(q, cache, tables, seq_lens, scale)
    real = seq_lens > 0  # a row of length 0 (graph padding) attends to nothing: zeros
    expected = REFERENCE.decode_attention(
        q.float(), (cache[0].float(), cache[1].float()), tables, seq_lens, scale
    )
    assert rel_error(actual[real], expected[real]) < 2 * TOLERANCE[dtype]
    assert not actual[~real].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outs,ins", [(96, 576), (50, 100), (9, 2100)])  # one tile, three tiles
def test_the_one_row_linear_matches_reference(dtype, outs, ins):
    x = torch.randn(1, ins).to(dtype)
    weight = (torch.randn(outs, ins) / ins**0.5).to(dtype)
    expected = REFERENCE.linear(x.float(), weight.float())
    assert rel_error(triton_linear.one_row_linear(x, weight), expected) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="one unit-stride row"):
        triton_linear.one_row_linear(torch.cat([x, x]), weight)
