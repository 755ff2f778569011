"""The Triton prefill attention kernel on the device (graphguard/kernels/triton_prefill.py):
against the plain PyTorch prefill attention in float32 at realistic lengths in bfloat16 (block
size 16), bitwise repeatable and equal under graph replay, a sequence's output independent of
its neighbours; a model's chunked prefill through it gives the reference set's hidden states,
and an engine with the Triton set scores a long chunked prompt as the reference set does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from graphguard.engine.config import PRESETS
from graphguard.engine.models import DecoderModel, build_model
from graphguard.engine.models.attention import AttentionMetadata
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.kernels import HeadShape, KernelChoice, TorchKernels, select_kernels
from graphguard.kernels import triton_prefill as kernel
from tests.gpu.test_engine_gpu import loaded, make  # noqa: F401
from tests.kernel_cases import rel_error
from tests.prefill_cases import PackedPrefill, packed_prefill, reference_attention

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
TOLERANCE = 1e-2  # bf16 operands, float32 accumulation (as the other kernels' GPU tests)
# SmolLM2-135M, Qwen3-0.6B, Llama-3.1-8B (GQA 4), and plain multi-head attention
HEADS = {
    "smollm2": HeadShape(9, 3, 64),
    "qwen3": HeadShape(16, 8, 128),
    "llama8b": HeadShape(32, 8, 128),
    "mha": HeadShape(8, 8, 64),
}
# (new tokens, cached tokens) per sequence
STEPS = {
    "fresh": ([1000, 37, 2048, 513, 1], [0, 0, 0, 0, 0]),
    "continued": ([1500, 1, 300, 77], [2500, 3000, 0, 16]),
    "long_chunk": ([4096], [4000]),
    # few tokens after a long prefix: the launcher's tiles for a small grid
    "short_after_long": ([50, 3], [3000, 1200]),
}


def run(batch: PackedPrefill, scale: float) -> torch.Tensor:
    meta = batch.meta
    return kernel.prefill_attention(
        batch.q, batch.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
    )


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_prefill_attention_matches_reference(heads, step):
    batch = packed_prefill(heads, *step, BF16, "cuda")
    scale = heads.head_dim**-0.5
    assert rel_error(run(batch, scale), reference_attention(batch, scale)) < TOLERANCE


def test_replays_bitwise_equal_to_eager_and_a_sequence_ignores_its_neighbours():
    batch = packed_prefill(HEADS["qwen3"], *STEPS["continued"], BF16, "cuda")
    eager, again = run(batch, 0.1), run(batch, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run(batch, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, again) and torch.equal(eager, replayed)
    meta, rows = batch.meta, STEPS["continued"][0][0]
    alone = kernel.prefill_attention(
        batch.q[:rows], batch.kv_cache, meta.query_start_loc[:2], meta.seq_lens[:1],
        meta.block_tables[:1], 0.1,
    )  # fmt: skip
    assert torch.equal(alone, eager[:rows])


def model_step(
    model: DecoderModel, kv: PagedKVStorage, step: list[tuple[int, int, int]]
) -> torch.Tensor:
    """Hidden states of a packed prefill of (table row, cached, new tokens) sequences whose
    tokens are a fixed function of their positions; no prefill groups planned."""
    size, width = kv.block_size, kv.num_blocks // 2
    tables = torch.arange(1, 1 + 2 * width, dtype=torch.int32).view(2, width)
    tokens = [(row, p) for row, first, n in step for p in range(first, first + n)]
    slots = [int(tables[r, p // size]) * size + p % size for r, p in tokens]
    seq_lens = [first + n for _, first, n in step]
    query_lens = [n for *_, n in step]
    meta = AttentionMetadata(
        packed=True,
        slot_mapping=torch.tensor(slots, device="cuda"),
        block_tables=tables[[row for row, _, _ in step]].cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).int().cuda(),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    ids = torch.tensor([(7919 * p + r) % 40000 + 10 for r, p in tokens], device="cuda")
    positions = torch.tensor([p for _, p in tokens], device="cuda")
    with torch.no_grad():
        return model(ids, positions, meta, kv)


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen3-0.6b"])
def test_a_models_chunked_prefill_matches_the_reference_set(preset):
    """A 2,560-token prompt prefilled in chunks of 1,536 and 1,024 tokens (the second beside a
    fresh 700-token prompt), 4 layers, through either kernel set: the same hidden states."""
    config = dataclasses.replace(PRESETS[preset], num_layers=4)
    fused = select_kernels(KernelChoice.TRITON, torch.device("cuda"), BF16).kernels
    outputs = []
    for kernels in (TorchKernels(), fused):
        model = build_model(config, dtype=BF16, device="cuda", seed=0)
        model.use_kernels(kernels)
        kv = PagedKVStorage(
            num_layers=4, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            num_blocks=2 * 160 + 1, block_size=16, dtype=BF16, device="cuda",
        )  # fmt: skip
        first = model_step(model, kv, [(0, 0, 1536)])
        outputs.append(torch.cat([first, model_step(model, kv, [(0, 1536, 1024), (1, 0, 700)])]))
    expected, actual = (out.float() for out in outputs)
    assert F.cosine_similarity(actual, expected, dim=-1).min() > 0.999
    assert rel_error(actual, expected) < 2e-2


def prompt_logprobs(loaded, kernels: str, prompt: list[int]) -> torch.Tensor:  # noqa: F811
    """The prompt's log-likelihoods (token 1 on) from an engine with `kernels` that prefills
    it in chunks of 512 tokens."""
    engine = make(
        loaded, kernels=kernels, max_num_seqs=4, max_model_len=4096, num_kv_blocks=300,
        max_num_batched_tokens=512, prefix_caching=False,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        engine.add_request("long", prompt, params)
        scored = []
        while engine.has_unfinished_requests():
            scored += [out.prompt_logprobs for out in engine.step() if out.prompt_logprobs]
    finally:
        engine.shutdown()
    assert len(scored) == 1 and len(scored[0]) == len(prompt)
    return torch.tensor([entry.logprob for entry in scored[0][1:]])


def test_an_engine_scores_a_long_chunked_prompt_as_the_reference_set_does(loaded):  # noqa: F811
    """A 3,000-token prompt in six chunks: the Triton set's prompt log-likelihoods are the
    reference set's within bfloat16's error, measured against their spread over the prompt."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 40000, (3000,), generator=g).tolist()
    expected = prompt_logprobs(loaded, "torch", prompt)
    actual = prompt_logprobs(loaded, "triton", prompt)
    centred = expected - expected.mean()
    assert rel_error(actual - expected.mean(), centred) < 5e-2
