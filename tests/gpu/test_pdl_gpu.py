"""Programmatic dependent launch (graphguard/kernels/launch.py, on by default) on the device:
on Hopper a chain of the decode step's kernels launched as dependents, eager or captured in a
graph, gives the bits of the same chain launched plainly, replay after replay with new inputs.
Each test turns it on itself, whatever the environment says."""

from __future__ import annotations

import pytest
import torch

from graphguard.kernels import launch, triton_decode, triton_linear, triton_mlp, triton_norm
from graphguard.kernels.reference import HeadShape
from tests.kernel_cases import BLOCK_SIZE, paged_batch

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
HIDDEN, INTER, LAYERS = 1024, 3072, 12


def hopper() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


def chain(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """A decoder's MLP blocks back to back: each kernel reads what the one before it wrote."""
    residual = torch.zeros_like(x)
    for norm, up, down in weights:
        h, residual = triton_norm.add_rms_norm(x, residual, norm, 1e-6)
        x = triton_linear.few_rows_linear(
            triton_mlp.silu_mul(triton_linear.few_rows_linear(h, up)), down
        )
    return triton_norm.add_rms_norm(x, residual, weights[0][0], 1e-6)[0]


@pytest.fixture(scope="module")
def weights() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF16)

    return [
        (randn(HIDDEN, scale=0.1) + 1, randn(2 * INTER, HIDDEN, scale=0.03),
         randn(HIDDEN, INTER, scale=0.02))
        for _ in range(LAYERS)
    ]  # fmt: skip


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch):
    """Kernels launch as dependents until the test calls plain(), then plainly."""
    if not hopper():
        pytest.skip("programmatic dependent launch needs Hopper or later")
    index = torch.cuda.current_device()
    monkeypatch.setitem(launch._BY_DEVICE, index, True)
    assert launch.dependent_launch(torch.device("cuda"))

    def set_plain() -> None:
        monkeypatch.setitem(launch._BY_DEVICE, index, False)

    return set_plain


@pytest.mark.parametrize("rows", [1, 16])
def test_a_chain_of_dependent_launches_gives_the_plain_chains_bits_eager_and_replayed(
    weights, plain, rows
):
    inputs = [torch.randn(rows, HIDDEN, device="cuda").to(BF16) for _ in range(6)]
    static = inputs[0].clone()
    dependent_eager = [chain(x, weights) for x in inputs]
    chain(static, weights)  # warm-up on the side stream's allocator, as captures do
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static, weights)
    replayed = []
    for x in inputs:
        static.copy_(x)
        graph.replay()
        replayed.append(static_out.clone())
    plain()
    expected = [chain(x, weights) for x in inputs]
    for want, eager, replay in zip(expected, dependent_eager, replayed, strict=True):
        assert torch.equal(eager, want) and torch.equal(replay, want)


def test_split_decode_attention_with_dependent_launches_matches_its_plain_launch(plain):
    heads = HeadShape(16, 8, 128)  # Qwen3-0.6B
    lens = [3000, 9000, 17, 1]  # split plans over a 9,008-token table; rows of one split
    q, cache, tables, seq_lens = paged_batch(heads, lens, 9008 // BLOCK_SIZE, BF16, "cuda")
    dependent = triton_decode.decode_attention(q, cache, tables, seq_lens, 0.088)
    plain()
    assert torch.equal(dependent, triton_decode.decode_attention(q, cache, tables, seq_lens, 0.088))
