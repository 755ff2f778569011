"""Decode steps launched ahead (graphguard/engine/step/overlap.py): the same tokens as plain decode,
whatever happens between steps while a step is in flight.

On a CPU the step launched ahead runs at once, so these tests check the bookkeeping (which
rows run, what each request gets, which blocks it holds), not the timing: that is measured
on the GPU by bench/decode.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphguard.engine.engine import LLMEngine
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.scheduling.sequence import Sequence, SequenceStatus
from graphguard.engine.step.overlap import decodes_ahead, resolve_overlap
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import make_engine, run_to_completion, token_ids_of

PROMPTS = ([5, 17, 301, 44, 9], [70, 71, 72], [900, 12, 12, 12, 12, 12, 12, 3, 8])


def _engine(model: LoadedModel, overlap: str = "on", **overrides: Any) -> LLMEngine:
    return make_engine(model, overlap_decode=overlap, **overrides)


def _greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def _run(model: LoadedModel, overlap: str, lengths: tuple[int, ...]) -> tuple[dict, LLMEngine]:
    engine = _engine(model, overlap)
    for i, (ids, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        engine.add_request(f"r{i}", ids, _greedy(n))
    return run_to_completion(engine), engine


def test_overlapped_decode_gives_exactly_the_tokens_of_plain_decode(tiny_qwen3: LoadedModel):
    lengths = (12, 7, 15)  # requests end at different steps: the batch shrinks twice
    plain, plain_engine = _run(tiny_qwen3, "off", lengths)
    ahead, engine = _run(tiny_qwen3, "on", lengths)
    for rid in plain:
        assert token_ids_of(ahead[rid]) == token_ids_of(plain[rid])
        assert ahead[rid][-1].finish_reason == plain[rid][-1].finish_reason == "length"
        assert [o.delta_text for o in ahead[rid]] == [o.delta_text for o in plain[rid]]
    assert plain_engine.stats()["num_steps_ahead"] == 0
    # most decode steps went ahead: all but the first after each change of the batch
    assert engine.stats()["num_steps_ahead"] >= 8
    assert engine.stats()["num_generated_tokens"] == sum(lengths)
    assert engine.kv.num_used_blocks == 0


def test_a_request_ending_on_eos_in_flight_ends_there_and_frees_its_blocks(
    tiny_qwen3: LoadedModel,
):
    plain, _ = _run(tiny_qwen3, "off", (12, 12, 12))
    tokens = token_ids_of(plain["r0"])
    eos = tokens[5]  # r0's sixth token ends it once it counts as EOS
    engine = _engine(tiny_qwen3)
    engine.tokenizer = _WithEos(engine.tokenizer, eos)
    engine.add_request("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12))
    engine.add_request("r1", PROMPTS[1], _greedy(12))
    outputs = run_to_completion(engine)
    expected = tokens[: tokens.index(eos) + 1]
    assert token_ids_of(outputs["r0"]) == expected
    assert outputs["r0"][-1].finish_reason == "stop"
    assert token_ids_of(outputs["r1"]) == token_ids_of(plain["r1"])  # its neighbour goes on
    assert engine.stats()["num_steps_ahead"] > 0
    assert engine.kv.num_used_blocks == 0


def test_an_abort_while_a_step_is_in_flight_drops_only_that_request(tiny_qwen3: LoadedModel):
    plain, _ = _run(tiny_qwen3, "off", (12, 12, 12))
    engine = _engine(tiny_qwen3)
    engine.add_request("r0", PROMPTS[0], _greedy(12))
    engine.add_request("r1", PROMPTS[1], _greedy(12))
    seen: dict[str, list[int]] = {"r0": [], "r1": []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
    assert engine._ahead is not None  # a step is in flight now
    engine.abort_request("r0")
    outputs = run_to_completion(engine)
    assert outputs["r0"][-1].finish_reason == "abort" and not outputs["r0"][-1].new_token_ids
    assert seen["r0"] == token_ids_of(plain["r0"])[: len(seen["r0"])]
    assert seen["r1"] + token_ids_of(outputs["r1"]) == token_ids_of(plain["r1"])
    assert engine.kv.num_used_blocks == 0


def test_a_request_arriving_while_a_step_is_in_flight_gets_its_tokens_alone(
    tiny_qwen3: LoadedModel,
):
    alone = {}
    for rid, ids in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
        engine = _engine(tiny_qwen3, "off")
        engine.add_request(rid, ids, _greedy(10))
        alone[rid] = token_ids_of(run_to_completion(engine)[rid])
    engine = _engine(tiny_qwen3)
    engine.add_request("a", PROMPTS[0], _greedy(10))
    outputs: dict[str, list] = {}
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine._ahead is not None
    engine.add_request("b", PROMPTS[2], _greedy(10))
    for rid, outs in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert token_ids_of(outputs["a"]) == alone["a"]
    assert token_ids_of(outputs["b"]) == alone["b"]


def test_new_weights_apply_from_the_next_step_with_no_token_lost_or_repeated(
    tiny_qwen3: LoadedModel,
):
    plain, _ = _run(tiny_qwen3, "off", (12, 12, 12))
    engine = _engine(tiny_qwen3)
    engine.add_request("r0", PROMPTS[0], _greedy(12))
    tokens: list[int] = []
    for _ in range(5):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert engine._ahead is not None
    engine.reload_weights(dict(engine.model.state_dict()))  # the same weights, in place
    tokens += token_ids_of(run_to_completion(engine)["r0"])
    assert tokens == token_ids_of(plain["r0"])


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": 2},
        {"logit_bias": ((7, 5.0),)},
        {"frequency_penalty": 0.5},
        {"temperature": 0.8, "seed": 3},
    ],
    ids=["logprobs", "logit_bias", "penalty", "sampled"],
)
def test_requests_whose_logits_the_host_reads_never_step_ahead(
    tiny_qwen3: LoadedModel, extra: dict[str, Any]
):
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **extra}
    results = []
    for overlap in ("off", "on"):
        engine = _engine(tiny_qwen3, overlap)
        engine.add_request("greedy", PROMPTS[1], _greedy(8))
        engine.add_request("other", PROMPTS[0], SamplingParams(**params))
        results.append(run_to_completion(engine))
        assert engine.stats()["num_steps_ahead"] == 0  # one such request holds the batch back
    for rid in ("greedy", "other"):
        assert token_ids_of(results[0][rid]) == token_ids_of(results[1][rid])


def test_a_step_goes_ahead_only_for_a_greedy_request_with_room_for_two_more_tokens():
    def seq(max_tokens: int, num_output: int, **extra: Any) -> Sequence:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)
        s = Sequence("r", [1, 2, 3], params, None)
        s.status = SequenceStatus.RUNNING
        for token in range(num_output):
            s.append_token(token)
        return s

    assert decodes_ahead(seq(8, 6), max_model_len=64)
    assert not decodes_ahead(seq(8, 7), max_model_len=64)  # its token in flight is its last
    assert not decodes_ahead(seq(8, 0), max_model_len=4)  # the model's length ends it
    assert not decodes_ahead(seq(8, 0, logprobs=0), max_model_len=64)
    finished = seq(8, 0)
    finished.finish("abort")
    assert not decodes_ahead(finished, max_model_len=64)


def test_overlap_is_on_by_default_on_cuda_only_and_never_across_ranks():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_overlap("auto", cuda, is_tensor_parallel=False)
    assert not resolve_overlap("auto", cpu, is_tensor_parallel=False)
    assert resolve_overlap("on", cpu, is_tensor_parallel=False)
    assert not resolve_overlap("on", cuda, is_tensor_parallel=True)
    assert not resolve_overlap("off", cuda, is_tensor_parallel=False)
    with pytest.raises(ValueError, match="overlap_decode"):
        resolve_overlap("sometimes", cpu, is_tensor_parallel=False)


class _WithEos:
    """The engine's tokenizer with one more end-of-sequence id."""

    def __init__(self, inner: Any, eos: int) -> None:
        self._inner = inner
        self.eos_token_ids = (*inner.eos_token_ids, eos)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
