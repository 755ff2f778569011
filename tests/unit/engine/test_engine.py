"""LLMEngine on the real embedded model: batching, preemption, stopping and sampling."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.engine import LLMEngine
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import (
    GREEDY,
    generate_alone,
    make_engine,
    one_torch_thread,  # noqa: F401 (fixture)
    run_to_completion,
    token_ids_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = (
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village near the sea, there lived",
)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompt_ids(embedded_model: LoadedModel) -> list[list[int]]:
    return [embedded_model.tokenizer.encode(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def alone(embedded_model: LoadedModel, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt with the engine to itself (the reference)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [generate_alone(embedded_model, ids, params) for ids in prompt_ids]


def _add_all(engine: LLMEngine, prompt_ids: list[list[int]], max_tokens: list[int]) -> None:
    for i, (ids, n) in enumerate(zip(prompt_ids, max_tokens, strict=True)):
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=n))


def test_batched_requests_get_exactly_their_alone_tokens(
    embedded_model: LoadedModel, prompt_ids: list[list[int]], alone: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    _add_all(engine, prompt_ids, [4, 6, 8])
    outputs = run_to_completion(engine)
    for i, n in enumerate([4, 6, 8]):
        assert token_ids_of(outputs[f"r{i}"]) == alone[i][:n]


def test_max_tokens_ends_a_request_with_length(
    embedded_model: LoadedModel, prompt_ids: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    engine.add_request("r", prompt_ids[1], SamplingParams(temperature=0.0, max_tokens=3))
    final = run_to_completion(engine)["r"][-1]
    assert (final.finished, final.finish_reason, final.num_output_tokens) == (True, "length", 3)


def test_max_model_len_ends_a_request_with_length(embedded_model: LoadedModel) -> None:
    engine = make_engine(embedded_model, max_model_len=16)
    prompt = embedded_model.tokenizer.encode("1, 2, 3, 4, 5,")[:14]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=10))
    final = run_to_completion(engine)["r"][-1]
    assert (final.finish_reason, final.num_output_tokens) == ("length", 2)


def test_decode_runs_decode_rows_only_and_mixed_steps_keep_request_order(
    embedded_model: LoadedModel, prompt_ids: list[list[int]], alone: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    default_decode = engine.forward.decode
    batch_sizes: list[int] = []

    def counting_decode(ids, positions, block_tables, seq_lens, slots):
        num_seqs, width = block_tables.shape
        assert width & (width - 1) == 0  # padded to a power-of-two number of blocks
        assert ids.shape == positions.shape == seq_lens.shape == slots.shape == (num_seqs,)
        batch_sizes.append(num_seqs)
        return default_decode(ids, positions, block_tables, seq_lens, slots)

    engine.forward.decode = counting_decode  # type: ignore[method-assign]
    _add_all(engine, prompt_ids[:2], [4, 6])
    outputs = [engine.step(), engine.step()]  # prefill only, then decode only
    engine.add_request("r2", prompt_ids[2], SamplingParams(temperature=0.0, max_tokens=8))
    outputs.append(engine.step())  # mixed: r0, r1 decode; r2 prefills
    assert [out.request_id for out in outputs[2]] == ["r0", "r1", "r2"]
    assert batch_sizes == [2, 2]
    rest = run_to_completion(engine)
    for i, n in enumerate([4, 6, 8]):
        steps = [out for step in outputs for out in step if out.request_id == f"r{i}"]
        assert token_ids_of(steps + rest.get(f"r{i}", [])) == alone[i][:n]


def test_preempted_requests_finish_with_their_alone_tokens(
    embedded_model: LoadedModel, prompt_ids: list[list[int]], alone: list[list[int]]
) -> None:
    # 6 usable blocks of 4 tokens: enough for any one request, not for all of them at once.
    engine = make_engine(embedded_model, num_kv_blocks=7)
    _add_all(engine, prompt_ids, [MAX_TOKENS] * 3)
    outputs = run_to_completion(engine)
    assert engine.stats()["num_preemptions"] > 0
    assert [token_ids_of(outputs[f"r{i}"]) for i in range(3)] == alone


def test_stop_string_ends_the_request_and_is_not_in_the_text(
    embedded_model: LoadedModel, prompt_ids: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=(" 7",))
    engine.add_request("r", prompt_ids[1], params)  # greedy: " 5, 6, 7, 8,"
    outputs = run_to_completion(engine)["r"]
    assert (outputs[-1].finish_reason, outputs[-1].text) == ("stop", " 5, 6,")
    assert "".join(out.delta_text for out in outputs) == " 5, 6,"


def test_abort_frees_the_blocks_at_once_and_reports_abort(
    embedded_model: LoadedModel, prompt_ids: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    engine.add_request("r", prompt_ids[2], GREEDY)
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort_request("r")
    assert engine.stats()["kv_blocks_used"] == 0
    (final,) = engine.step()
    assert (final.request_id, final.finished, final.finish_reason) == ("r", True, "abort")
    assert not engine.has_unfinished_requests()


def test_seeded_request_draws_the_same_tokens_whatever_its_batch(
    embedded_model: LoadedModel, prompt_ids: list[list[int]]
) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=4, seed=1234)
    by_itself = generate_alone(embedded_model, prompt_ids[2], seeded)
    engine = make_engine(embedded_model, seed=99)
    engine.add_request("other0", prompt_ids[0], SamplingParams(temperature=1.0, max_tokens=4))
    engine.add_request("seeded", prompt_ids[2], seeded)
    engine.add_request("other1", prompt_ids[1], SamplingParams(temperature=0.7, max_tokens=2))
    assert token_ids_of(run_to_completion(engine)["seeded"]) == by_itself


def test_top_k_one_samples_the_greedy_tokens(
    embedded_model: LoadedModel, prompt_ids: list[list[int]], alone: list[list[int]]
) -> None:
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=4, seed=5)
    assert generate_alone(embedded_model, prompt_ids[1], params) == alone[1][:4]


def test_padded_rows_from_decode_never_reach_the_sampler(
    embedded_model: LoadedModel, prompt_ids: list[list[int]], alone: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    default_decode = engine.forward.decode

    def padding_decode(ids, positions, block_tables, seq_lens, slots):
        logits = default_decode(ids, positions, block_tables, seq_lens, slots)
        return torch.cat([logits, torch.full_like(logits, float("nan"))])  # as a graph bucket

    engine.forward.decode = padding_decode  # type: ignore[method-assign]
    _add_all(engine, prompt_ids[:2], [3, 3])
    outputs = run_to_completion(engine)
    assert [token_ids_of(outputs[f"r{i}"]) for i in range(2)] == [alone[0][:3], alone[1][:3]]


def test_a_request_whose_sampling_fails_ends_alone_and_its_neighbours_go_on(
    embedded_model: LoadedModel, prompt_ids: list[list[int]], alone: list[list[int]]
) -> None:
    engine = make_engine(embedded_model)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine.add_request("r0", prompt_ids[0], greedy)
    engine.add_request("bad", prompt_ids[1], SamplingParams(temperature=1.0, top_p=0.5))
    engine.add_request("r2", prompt_ids[2], greedy)
    # a value that got past validation (0 in float32): the draw raises for this row alone
    object.__setattr__(engine._seqs["bad"].params, "top_p", 7e-46)
    outputs = run_to_completion(engine)
    (last_bad,) = outputs["bad"]
    assert last_bad.finished and last_bad.finish_reason == "abort"
    assert last_bad.error and "multinomial" in last_bad.error
    assert token_ids_of(outputs["r0"]) == alone[0] and token_ids_of(outputs["r2"]) == alone[2]
    assert engine.kv.num_used_blocks == 0  # the failed request's blocks went back too


def test_a_top_p_that_is_zero_in_float32_is_refused() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=7e-46).validate()
    SamplingParams(temperature=1.0, top_p=1e-45).validate()  # the least float32 above 0 is fine
