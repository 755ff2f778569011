"""The sampler: greedy, filters, and per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from graphguard.engine.tokens.sampling import SamplingParams, make_generator, sample, token_logprobs

VOCAB_SIZE = 64
CPU = torch.device("cpu")


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))


def _draws(logits: torch.Tensor, params: SamplingParams, seed: int, num_draws: int) -> list[int]:
    generator = make_generator(seed, CPU)
    return [sample(logits, [params], [generator])[0] for _ in range(num_draws)]


def test_greedy_picks_the_argmax_of_every_row() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [None] * 4) == logits.argmax(dim=-1).tolist()


def test_top_k_one_equals_greedy_at_any_temperature() -> None:
    logits = _logits(3)
    params = [SamplingParams(temperature=5.0, top_k=1)] * 3
    generators = [make_generator(i, CPU) for i in range(3)]
    assert sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_top_k_draws_only_among_the_k_best_tokens() -> None:
    logits = _logits(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    draws = _draws(logits, SamplingParams(temperature=10.0, top_k=3), seed=1, num_draws=200)
    assert set(draws) == allowed


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.2: top_p 0.7 needs the first two, never the third.
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    draws = _draws(logits, SamplingParams(top_p=0.7), seed=2, num_draws=300)
    assert set(draws) == {0, 1}


def test_same_seed_gives_the_same_draws() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=1.5, seed=7)
    assert _draws(logits, params, 7, 20) == _draws(logits, params, 7, 20)
    assert _draws(logits, params, 7, 20) != _draws(logits, params, 8, 20)


def test_seeded_row_ignores_what_else_is_in_the_batch() -> None:
    logits = _logits(3, seed=5)
    params = SamplingParams(temperature=2.0)
    alone = [sample(logits[1:2], [params], [make_generator(11, CPU)])[0]]
    batch_generators = [make_generator(3, CPU), make_generator(11, CPU), make_generator(4, CPU)]
    together = sample(logits, [params, params, params], batch_generators)
    assert together[1] == alone[0]


def test_greedy_rows_leave_the_random_rows_draws_unchanged() -> None:
    logits = _logits(2, seed=9)
    hot = SamplingParams(temperature=3.0)
    alone = _draws(logits[1:2], hot, seed=21, num_draws=10)
    generator = make_generator(21, CPU)
    mixed = [
        sample(logits, [SamplingParams(temperature=0.0), hot], [None, generator])[1]
        for _ in range(10)
    ]
    assert mixed == alone


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=-3), "max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=100.5), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.01), "top_p"),
        (SamplingParams(top_p=float("nan")), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(logprobs=True), "logprobs"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(frequency_penalty=-2.01), "frequency_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    ],
)
def test_validate_rejects_out_of_range_values(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_validate_accepts_the_defaults_and_the_edges() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1).validate()
    SamplingParams(temperature=100.0, top_p=1e-6, stop=("\n",)).validate()


def test_a_tiny_temperature_samples_the_argmax_instead_of_failing():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 4.0]])
    tiny = SamplingParams(temperature=1e-40, seed=1)
    small = SamplingParams(temperature=1e-3, seed=1)
    gens = [make_generator(1, logits.device), make_generator(2, logits.device)]
    assert sample(logits, [tiny, small], gens) == [1, 2]


def test_token_logprobs_are_log_softmax_of_the_chosen_token_with_the_best_alternatives() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 4.0, 1.0], [9.0, 0.0, 0.0, 0.0]])
    result = token_logprobs(logits, [2, 2, 0], [2, 0, None])
    expected = torch.log_softmax(logits, dim=-1)
    first, second, third = result
    assert first is not None and second is not None and third is None
    assert first.token_id == 2 and math.isclose(first.logprob, expected[0, 2].item(), rel_tol=1e-6)
    assert [i for i, _ in first.top] == [1, 2]  # best first
    assert math.isclose(first.top[0][1], expected[0, 1].item(), rel_tol=1e-6)
    assert second.top == () and math.isclose(second.logprob, expected[1, 2].item(), rel_tol=1e-6)
    assert token_logprobs(logits, [0, 0, 0], [None, None, None]) == [None, None, None]


def test_a_seed_outside_64_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        SamplingParams(seed=2**64).validate()
    SamplingParams(seed=2**63 - 1).validate()
    SamplingParams(seed=-(2**63)).validate()
