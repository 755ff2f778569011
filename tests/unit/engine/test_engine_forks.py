"""Forks on the real embedded model: n choices from one prefill get the tokens each would get
alone (greedy; the prompt prefilled in chunks, its last block partly filled), seeded forks
draw their own streams, and no block outlives them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from graphguard.engine.engine import LLMEngine
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams, fork_seed
from graphguard.kernels.reference import TorchKernels
from tests.unit.engine.fixtures_engine import (
    generate_alone,
    make_engine,
    one_torch_thread,  # noqa: F401 - a fixture
    run_to_completion,
    token_ids_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
PROMPT = "The capital of France is a big city that"  # 9 tokens: the last of 3 blocks is partial
# A step's budget below the prompt: the parent is prefilled in chunks before its forks start.
CHUNKED = {"max_num_batched_tokens": 4}


def _add_group(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> None:
    engine.add_request("c-0", prompt, params[0])
    for j, one in enumerate(params[1:], start=1):
        engine.add_request(f"c-{j}", prompt, one, fork_of="c-0")


@pytest.mark.parametrize("row_area", [0, 512 * 2048], ids=["grouped", "rows"])
def test_greedy_forks_get_the_alone_tokens_from_one_chunked_prefill(
    embedded_model: LoadedModel, row_area: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prefills grouped (the reference set's way) and run as rows (the Triton set's)
    monkeypatch.setattr(TorchKernels, "row_prefill_area", row_area)
    prompt = embedded_model.tokenizer.encode(PROMPT)
    assert len(prompt) % 4  # block_size 4: the forks copy a partly filled last block
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = make_engine(embedded_model, **CHUNKED)
    one.add_request("alone", prompt, greedy)
    alone = token_ids_of(run_to_completion(one)["alone"])
    engine = make_engine(embedded_model, **CHUNKED)
    _add_group(engine, prompt, [greedy] * 3)
    outputs = run_to_completion(engine)
    assert [token_ids_of(outputs[f"c-{j}"]) for j in range(3)] == [alone] * 3
    # Three choices cost the prefill of one (its last prompt token runs as a decode row).
    assert engine.stats()["num_prefilled_tokens"] == one.stats()["num_prefilled_tokens"]
    assert engine.stats()["num_prefilled_tokens"] >= len(prompt) - 1
    assert engine.kv.num_used_blocks == 0


def test_seeded_forks_draw_what_their_seeds_draw_alone(embedded_model: LoadedModel) -> None:
    prompt = embedded_model.tokenizer.encode(PROMPT)
    params = [
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=fork_seed(21, j))
        for j in range(3)
    ]
    engine = make_engine(embedded_model)
    _add_group(engine, prompt, params)
    outputs = run_to_completion(engine)
    got = [token_ids_of(outputs[f"c-{j}"]) for j in range(3)]
    assert got == [generate_alone(embedded_model, prompt, p) for p in params]
    assert len({tuple(tokens) for tokens in got}) == 3


def test_aborting_the_first_choice_mid_prefill_lets_the_others_finish(
    embedded_model: LoadedModel,
) -> None:
    prompt = embedded_model.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = make_engine(embedded_model, **CHUNKED)
    _add_group(engine, prompt, [greedy] * 3)
    engine.step()  # the first chunk of the prompt
    engine.abort_request("c-0")
    outputs = run_to_completion(engine)
    alone = generate_alone(embedded_model, prompt, greedy)
    assert outputs["c-0"][-1].finish_reason == "abort"
    assert [token_ids_of(outputs[f"c-{j}"]) for j in (1, 2)] == [alone] * 2
    assert engine.kv.num_used_blocks == 0


def test_a_fork_of_a_request_that_has_started_is_refused(embedded_model: LoadedModel) -> None:
    prompt = embedded_model.tokenizer.encode(PROMPT)
    engine = make_engine(embedded_model)
    engine.add_request("c-0", prompt, SamplingParams(max_tokens=2))
    engine.step()
    with pytest.raises(ValueError, match="cannot be forked"):
        engine.add_request("c-1", prompt, SamplingParams(max_tokens=2), fork_of="c-0")
    with pytest.raises(ValueError, match="same prompt"):
        engine.add_request("c-2", prompt[:-1], SamplingParams(max_tokens=2), fork_of="c-0")
    run_to_completion(engine)
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_forks_keep_their_own_sampling_params(embedded_model: LoadedModel) -> None:
    prompt = embedded_model.tokenizer.encode(PROMPT)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine = make_engine(embedded_model)
    _add_group(engine, prompt, [short, replace(short, max_tokens=5)])
    outputs = run_to_completion(engine)
    assert [outputs[f"c-{j}"][-1].num_output_tokens for j in (0, 1)] == [2, 5]
