"""The fused Triton kernels on the device: each against the reference in bfloat16 across the
two model families' shapes, deterministic under graph replay, at most ten kernels per decoder
layer in the captured decode step, and the same greedy tokens as the reference path."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from graphguard.core.inventory import load_bindings, read_inventory
from graphguard.engine.config import PRESETS
from graphguard.engine.models import build_model
from graphguard.engine.models.forward import EagerForward
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.kernels import (
    KernelChoice,
    TorchKernels,
    select_kernels,
    triton_linear,
    triton_mlp,
    triton_norm,
)
from tests.kernel_cases import (
    BLOCK_SIZE,
    HEADS,
    REFERENCE,
    float_norm,
    paged_batch,
    qk_norm,
    rel_error,
    rope_tables,
)

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
TOLERANCE = 1e-2  # bf16 operands, float32 accumulation (METHOD.md: between 1e-3 and 1e-2)
MAX_KERNELS_PER_LAYER = 10


@pytest.fixture(scope="module")
def fused() -> TorchKernels:
    selection = select_kernels(KernelChoice.AUTO, torch.device("cuda"), BF16)
    assert selection.name == "triton", selection.describe()
    return selection.kernels


@pytest.mark.parametrize("num_rows,hidden", [(1, 576), (33, 1024), (7, 4096)])
def test_add_rms_norm_matches_reference(fused, num_rows, hidden):
    x, residual = torch.randn(2, num_rows, hidden, device="cuda").to(BF16)
    weight = (torch.rand(hidden, device="cuda") + 0.5).to(BF16)
    out, summed = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)  # the sum rounds exactly as the unfused add
    ref_out, _ = REFERENCE.add_rms_norm(x.float(), residual.float(), weight.float(), 1e-6)
    assert rel_error(out, ref_out) < TOLERANCE


@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize(
    "out_features,in_features",
    [(960, 576), (3072, 576), (576, 1536), (1024, 3072), (1024, 2048)],
)
def test_linear_matches_reference_and_keeps_a_rows_bits_in_any_batch(
    fused, rows, out_features, in_features
):
    x = torch.randn(rows, in_features, device="cuda").to(BF16)
    weight = (torch.randn(out_features, in_features, device="cuda") / in_features**0.5).to(BF16)
    out = fused.linear(x, weight)
    assert rel_error(out, REFERENCE.linear(x.float(), weight.float())) < TOLERANCE
    if 2 < rows <= 16:  # the few-rows kernel: rows give the same bits in any batch of 2-16
        assert torch.equal(out[:2], fused.linear(x[:2], weight))
    if rows == 1:  # the one-row kernel: its own sum, within rounding of the few-rows kernel's
        assert rel_error(out, triton_linear.few_rows_linear(x, weight)) < 1e-2


@pytest.mark.parametrize("out_features,in_features", [(4096, 1024), (1024, 3072), (960, 576)])
def test_the_one_row_linear_gives_the_same_bits_eager_and_replayed(out_features, in_features):
    """A batch of one (`one_row_linear`, weight loaded before the wait as a dependent launch)
    within bfloat16 of the reference, the same bits on every call and every replay."""
    x = torch.randn(1, in_features, device="cuda").to(BF16)
    weight = (torch.randn(out_features, in_features, device="cuda") / in_features**0.5).to(BF16)
    eager = triton_linear.one_row_linear(x, weight)
    assert rel_error(eager, REFERENCE.linear(x.float(), weight.float())) < TOLERANCE
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_linear.one_row_linear(static, weight)
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        assert torch.equal(replayed, eager)
    other = torch.randn_like(x)
    static.copy_(other)
    graph.replay()
    assert torch.equal(replayed, triton_linear.one_row_linear(other, weight))


def test_a_split_linear_gives_the_same_bits_on_every_call_and_replay(fused):
    """K split over programs whose last to arrive adds the partials in split order: the
    same bits eager, again, and from a graph replayed many times (the arrival counters are
    left at zero by each launch)."""
    x = torch.randn(16, 3072, device="cuda").to(BF16)
    weight = (torch.randn(1024, 3072, device="cuda") / 3072**0.5).to(BF16)
    plan = triton_linear.plan_linear(3072, 1024, split=True)
    assert plan.splits > 1
    linear = triton_linear.few_rows_linear
    eager = linear(x, weight, plan)
    assert all(torch.equal(eager, linear(x, weight, plan)) for _ in range(20))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = linear(x, weight, plan)
    for _ in range(50):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(eager, replayed)
    assert not triton_linear.arrival_counters(x.device).any()


def test_silu_mul_matches_reference(fused):
    gate_up = torch.randn(65, 2 * 3072, device="cuda").to(BF16)
    assert rel_error(fused.silu_mul(gate_up), REFERENCE.silu_mul(gate_up.float())) < TOLERANCE


@pytest.mark.parametrize("heads", HEADS, ids=["smollm2", "qwen3"])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_with_cache_write_matches_reference(fused, heads, with_norm):
    num_tokens = 37
    width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    qkv = torch.randn(num_tokens, width, device="cuda").to(BF16)
    cos, sin = rope_tables(num_tokens, heads.head_dim, BF16, "cuda")
    norm = qk_norm(heads, BF16, "cuda") if with_norm else None
    q_ref, k_ref, v_ref = REFERENCE.rope_qkv(
        qkv.float(), cos.float(), sin.float(), heads, float_norm(norm)
    )
    shape = (8, BLOCK_SIZE, heads.num_kv_heads, heads.head_dim)
    cache = (
        torch.zeros(shape, dtype=BF16, device="cuda"),
        torch.zeros(shape, dtype=BF16, device="cuda"),
    )
    slots = torch.randperm(8 * BLOCK_SIZE, device="cuda")[:num_tokens]
    q = fused.rope_qkv_write(qkv, cos, sin, heads, norm, cache, slots)
    flat_k, flat_v = (c.view(-1, heads.num_kv_heads, heads.head_dim) for c in cache)
    assert rel_error(q, q_ref) < TOLERANCE and rel_error(flat_k[slots], k_ref) < TOLERANCE
    assert torch.equal(flat_v[slots], v_ref.to(BF16))


@pytest.mark.parametrize("heads", HEADS, ids=["smollm2", "qwen3"])
@pytest.mark.parametrize(
    "lens,width",
    [([1], 1), ([7, 16, 17], 2), ([300, 1, 511, 77, 2048], 128), ([0, 5], 4), ([30000], 2048)],
)
def test_decode_attention_matches_reference(fused, heads, lens, width):
    q, cache, tables, seq_lens = paged_batch(heads, lens, width, BF16, "cuda")
    scale = heads.head_dim**-0.5
    out = fused.decode_attention(q, cache, tables, seq_lens, scale)
    expected = REFERENCE.decode_attention(
        q.float(), (cache[0].float(), cache[1].float()), tables, seq_lens, scale
    )
    real = seq_lens > 0
    assert rel_error(out[real], expected[real]) < TOLERANCE
    assert not out[~real].any()  # a padding row of length 0 is zeros, never NaN


def test_a_rows_decode_attention_is_the_same_unpadded_and_in_its_buckets_batch(fused):
    # 3 rows at 16k slots, alone and padded: the split plan reads the width, never the batch
    heads = HEADS[1]
    q, cache, tables, seq_lens = paged_batch(heads, [15000, 3, 9000], 1024, BF16, "cuda")
    alone = fused.decode_attention(q, cache, tables, seq_lens, 0.1)
    pad_q = torch.cat([q, torch.randn_like(q[:1])])
    pad_tables = torch.cat([tables, torch.zeros_like(tables[:1])])  # the dummy block
    pad_lens = torch.cat([seq_lens, torch.ones_like(seq_lens[:1])])
    padded = fused.decode_attention(pad_q, cache, pad_tables, pad_lens, 0.1)
    assert torch.equal(padded[:3], alone)


def test_long_contexts_reuse_the_decode_kernels_compiled_at_a_short_one(fused):
    # NOTE: the split plan's integers are not specialized on, so a 30k context (256 splits)
    # finds the kernels a 512-slot warm-up (4 splits) compiled, rather than compiling mid-serving
    from triton.runtime.jit import JITFunction

    from graphguard.kernels import triton_decode

    def compiled() -> int:
        kernels = [k for k in vars(triton_decode).values() if isinstance(k, JITFunction)]
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    def decode(lens: list[int], width: int) -> None:
        q, cache, tables, seq_lens = paged_batch(HEADS[1], lens, width, BF16, "cuda")
        fused.decode_attention(q, cache, tables, seq_lens, 0.1)

    decode([300], 32)
    warm = compiled()
    for lens, width in (([8000], 512), ([30000], 2048), ([5000] * 16, 512)):
        decode(lens, width)
    assert compiled() == warm


def test_decode_attention_replays_bitwise_equal_to_eager(fused):
    heads = HEADS[1]
    lens = torch.randint(1, 64 * BLOCK_SIZE, (32,)).tolist()
    q, cache, tables, seq_lens = paged_batch(heads, lens, 64, BF16, "cuda")
    eager = fused.decode_attention(q, cache, tables, seq_lens, 0.1)
    again = fused.decode_attention(q, cache, tables, seq_lens, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused.decode_attention(q, cache, tables, seq_lens, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, again) and torch.equal(eager, replayed)


def decode_step(preset: str, num_layers: int, kernels: TorchKernels, batch: int = 4):
    """An EagerForward over a random model with `num_layers` layers, its decode inputs; the
    same weights, cache and inputs on every call."""
    torch.manual_seed(0)
    config = dataclasses.replace(PRESETS[preset], num_layers=num_layers)
    model = build_model(config, dtype=BF16, device="cuda", seed=0)
    model.use_kernels(kernels)
    width = 8
    kv = PagedKVStorage(
        num_layers=num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        num_blocks=batch * width + 1, block_size=BLOCK_SIZE, dtype=BF16, device="cuda",
    )  # fmt: skip
    for cache in (*kv.k_cache, *kv.v_cache):
        cache.normal_()
    lens = torch.randint(2, width * BLOCK_SIZE, (batch,))
    tables = (torch.arange(batch * width).view(batch, width) + 1).to(torch.int32)
    last = lens - 1
    slots = tables.long()[torch.arange(batch), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    inputs = (
        torch.randint(0, config.vocab_size, (batch,)),
        last,
        tables,
        lens.to(torch.int32),
        slots,
    )
    return EagerForward(model, kv), [t.cuda() for t in inputs]


def captured_kernels(preset: str, num_layers: int, kernels: TorchKernels) -> int:
    forward, inputs = decode_step(preset, num_layers, kernels)
    forward.decode(*inputs)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # the inventory reads the graph's nodes
    with torch.cuda.graph(graph):
        forward.decode(*inputs)
    inventory = read_inventory(graph, "cuda")
    assert inventory.is_available, inventory.unavailable
    return sum(inventory.kernels.values())


@pytest.mark.skipif(isinstance(load_bindings(), str), reason="needs cuda.bindings")
@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen3-0.6b"])
def test_captured_decode_step_has_at_most_ten_kernels_per_layer(fused, preset, record_property):
    per_layer = {}
    for kernels in (TorchKernels(), fused):
        two, four = (captured_kernels(preset, n, kernels) for n in (2, 4))
        per_layer[kernels.name] = (four - two) / 2
    record_property("kernels_per_layer", per_layer)
    print(f"{preset}: kernels per decoder layer {per_layer}")
    assert per_layer["triton"] <= MAX_KERNELS_PER_LAYER, per_layer
    assert per_layer["triton"] < per_layer["torch"]


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen3-0.6b"])
def test_fused_and_reference_paths_agree_on_logits_and_greedy_tokens(fused, preset):
    reference_step, inputs = decode_step(preset, 6, TorchKernels(), batch=32)
    fused_step, _ = decode_step(preset, 6, fused, batch=32)  # same seed: same weights and KV
    expected, got = reference_step.decode(*inputs), fused_step.decode(*inputs)
    assert rel_error(got, expected) < 2e-2
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * expected.std()  # not a near tie
    assert clear.sum() >= 8
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_masked_prefill_attention_runs_on_the_memory_efficient_kernel():
    """Grouped prefill attention (a boolean mask, fewer K/V heads than query heads) runs on
    the memory-efficient kernel alone, not on cuDNN's per-shape plans or the math kernel, and
    agrees with float32 math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphguard.engine.models.attention import _masked_sdpa

    q = torch.randn(12, 9, 16, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(12, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(12, 1, 16, 16, device="cuda", dtype=torch.bool).tril()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = _masked_sdpa(q, kv, kv, mask, 0.125)
    wide = kv.float().repeat_interleave(3, dim=1)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.float(), wide, wide, attn_mask=mask, scale=0.125
    )
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("hidden,inter", [(1024, 3072), (576, 1536)])
def test_gemm_prologues_give_the_unfused_kernels_results_and_replay_bit_for_bit(
    rows, hidden, inter
):
    """GRAPHGUARD_GEMM_PROLOGUES' kernels (docs/kernels.md): SiLU into the down projection
    gives the unfused pair's bits; the norm into the q/k/v GEMM its residual sum's bits and
    its output within bfloat16's band; both replay their eager call's bits."""
    x, residual = torch.randn(2, rows, hidden, device="cuda").to(BF16)
    gamma = (torch.rand(hidden, device="cuda") + 0.5).to(BF16)
    qkv_weight = (torch.randn(4096, hidden, device="cuda") / hidden**0.5).to(BF16)
    gate_up = torch.randn(rows, 2 * inter, device="cuda").to(BF16)
    down = (torch.randn(hidden, inter, device="cuda") / inter**0.5).to(BF16)
    normed, summed = triton_norm.add_rms_norm(x, residual, gamma, 1e-6)
    unfused = (triton_linear.few_rows_linear(normed, qkv_weight),
               triton_linear.few_rows_linear(triton_mlp.silu_mul(gate_up), down))  # fmt: skip

    def fused_pair() -> tuple[torch.Tensor, ...]:
        out, fused_sum = triton_linear.few_rows_norm_linear(x, residual, gamma, 1e-6, qkv_weight)
        return out, fused_sum, triton_linear.few_rows_silu_linear(gate_up, down)

    out, fused_sum, silu_out = fused_pair()
    assert torch.equal(silu_out, unfused[1]) and torch.equal(fused_sum, summed)
    assert rel_error(out, unfused[0]) < TOLERANCE
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fused_pair()
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(static, (out, fused_sum, silu_out), strict=True))


@pytest.mark.skipif(isinstance(load_bindings(), str), reason="needs cuda.bindings")
def test_gemm_prologues_take_three_kernels_a_layer_out_of_the_decode_step(fused, monkeypatch):
    """With the norms and SiLU inside the GEMMs the captured Qwen3-0.6B decode step has three
    kernels a layer fewer, and its logits stay within bfloat16's band of the separate kernels'
    and give their clear greedy tokens."""
    separate = captured_kernels("qwen3-0.6b", 4, fused) - captured_kernels("qwen3-0.6b", 2, fused)
    plain_step, inputs = decode_step("qwen3-0.6b", 6, fused, batch=16)
    expected = plain_step.decode(*inputs)
    monkeypatch.setattr(fused, "gemm_prologues", True)
    inside = captured_kernels("qwen3-0.6b", 4, fused) - captured_kernels("qwen3-0.6b", 2, fused)
    assert (separate - inside) / 2 == 3, (separate, inside)
    got = decode_step("qwen3-0.6b", 6, fused, batch=16)[0].decode(*inputs)
    assert rel_error(got, expected) < 2e-2
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * expected.std()
    assert clear.sum() >= 4
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
