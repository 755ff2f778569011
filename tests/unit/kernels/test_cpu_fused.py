"""The fused CPU kernels of the 4-bit set (graphguard/kernels/cpu_fused.py) against the
reference ops: the same math in float32 (bfloat16 where the 4-bit GEMMs read it), row by row,
so a row's result does not depend on the batch around it."""

from __future__ import annotations

import pytest
import torch

from graphguard.kernels import cpu_fused
from graphguard.kernels.q4 import Q4Kernels
from tests.kernel_cases import HEADS, REFERENCE, paged_batch, qk_norm, rel_error, rope_tables

BF16 = 2**-8  # bfloat16's relative rounding error


def test_bfloat16_bits_round_as_torch_does() -> None:
    values = torch.cat(
        (
            torch.randn(4096) * torch.logspace(-30, 30, 4096),
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, 3.0e38]),
            # ties: halfway between two bfloat16 values, rounded to the even one
            torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]),
        )
    )
    bits = torch.empty(len(values), dtype=torch.int16)
    cpu_fused._f32_to_bf16(values.numpy(), bits.numpy())
    assert torch.equal(bits, values.to(torch.bfloat16).view(torch.int16))
    back = torch.empty(len(values))
    cpu_fused._bf16_to_f32(bits.numpy(), back.numpy())
    assert torch.equal(back, values.to(torch.bfloat16).float())
    nan = torch.empty(1, dtype=torch.int16)
    cpu_fused._f32_to_bf16(torch.tensor([float("nan")]).numpy(), nan.numpy())
    assert nan.view(torch.bfloat16).isnan().all()


@pytest.mark.parametrize("num_rows", [1, 5])
def test_norms_match_the_reference(num_rows: int) -> None:
    kernels = Q4Kernels()
    x = torch.randn(num_rows, 576).bfloat16()  # a GEMM's output
    residual = torch.randn(num_rows, 576)
    weight = torch.rand(576) + 0.5
    normed, summed = kernels.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_sum = REFERENCE.add_rms_norm(x.float(), residual, weight, 1e-5)
    assert normed.dtype == torch.bfloat16 and summed.dtype == torch.float32
    assert rel_error(summed, ref_sum) < 1e-6
    assert rel_error(normed, ref_normed) < BF16
    plain = kernels.rms_norm(residual, weight, 1e-5)
    assert rel_error(plain, REFERENCE.rms_norm(residual, weight, 1e-5)) < BF16
    # [batch, tokens, hidden] rows as well
    shaped = kernels.rms_norm(residual.view(1, num_rows, 576), weight, 1e-5)
    assert shaped.shape == (1, num_rows, 576) and torch.equal(shaped.view_as(plain), plain)


def test_silu_mul_matches_the_reference() -> None:
    gate_up = torch.randn(3, 2 * 1536).bfloat16()
    out = Q4Kernels().silu_mul(gate_up)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, REFERENCE.silu_mul(gate_up.float())) < BF16


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("normed", [False, True])
def test_decode_attention_matches_rope_write_and_attention_of_the_reference(heads, normed):
    lens = [1, 17, 40, 33]  # one token, and contexts that end mid-block
    q, (k_cache, v_cache), tables, seq_lens = paged_batch(heads, lens, 4, torch.float32, "cpu")
    qkv_width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    qkv = torch.randn(len(lens), qkv_width).bfloat16()
    cos, sin = rope_tables(len(lens), heads.head_dim, torch.float32, "cpu")
    norm = qk_norm(heads, torch.float32, "cpu") if normed else None
    # each row's new token goes at its last position
    last = (seq_lens - 1).long()
    slots = tables.long().gather(1, (last // 16)[:, None]).squeeze(1) * 16 + last % 16
    ref_cache = (k_cache.clone(), v_cache.clone())
    expected = REFERENCE.attend_decode(
        qkv.float(), (cos, sin), heads, norm, ref_cache, slots, tables, seq_lens, 0.125
    )
    got = Q4Kernels().attend_decode(
        qkv, (cos, sin), heads, norm, (k_cache, v_cache), slots, tables, seq_lens, 0.125
    )
    assert got.dtype == torch.bfloat16
    assert rel_error(got.view_as(expected), expected) < 2 * BF16
    assert rel_error(k_cache, ref_cache[0]) < 1e-6 and torch.equal(v_cache, ref_cache[1])


def test_a_rows_attention_does_not_depend_on_the_batch_around_it() -> None:
    heads = HEADS[0]
    lens = [30, 7, 50]
    q, cache, tables, seq_lens = paged_batch(heads, lens, 4, torch.float32, "cpu")
    k_cache, v_cache = (c.view(-1, heads.num_kv_heads, heads.head_dim).numpy() for c in cache)

    def attend(rows: slice) -> torch.Tensor:
        out = torch.empty(len(lens), heads.num_heads * heads.head_dim, dtype=torch.int16)[rows]
        cpu_fused._decode_attention_rows(
            q[rows].numpy(), k_cache, v_cache, tables[rows].numpy(), seq_lens[rows].numpy(),
            16, 0.125, out.numpy(),
        )  # fmt: skip
        return out

    assert torch.equal(attend(slice(0, 3))[1], attend(slice(1, 2))[0])
