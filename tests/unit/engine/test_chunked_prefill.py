"""Chunked prefill on the real embedded model: a prompt longer than what a step has left is
prefilled over several steps and gives what one prefill gives."""

from __future__ import annotations

import pytest

from graphguard.engine.models.images import expand_image_tokens
from graphguard.engine.tokens.sampling import SamplingParams
from tests.unit.engine.fixtures_engine import (  # noqa: F401
    make_engine,
    one_torch_thread,
    run_to_completion,
    token_ids_of,
)
from tests.unit.engine.test_vision_engine import generate as generate_with_images
from tests.unit.engine.test_vision_engine import image, image_prompt

PROMPTS = {
    "a": "The capital of France is a city with a long history, and its name is",
    "b": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "c": "Water boils at a temperature of",
}
CHUNKED = {"max_num_batched_tokens": 5}  # max_num_seqs 4: at most one prompt token per step


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):  # noqa: F811
    pass


def generate(engine, params: SamplingParams) -> tuple[dict, int]:
    for rid, text in PROMPTS.items():
        engine.add_request(rid, engine.tokenizer.encode(text), params)
    steps, outputs = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
    return outputs, steps


def test_chunked_prefill_gives_the_tokens_of_whole_prefills(embedded_model):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    whole = make_engine(embedded_model)
    chunked = make_engine(embedded_model, **CHUNKED)
    try:
        expected, whole_steps = generate(whole, params)
        actual, chunked_steps = generate(chunked, params)
        assert {r: token_ids_of(o) for r, o in actual.items()} == {
            r: token_ids_of(o) for r, o in expected.items()
        }
        assert chunked_steps > whole_steps + 10  # the prompts really went in pieces
        assert chunked.kv.num_used_blocks == 0
    finally:
        whole.shutdown()
        chunked.shutdown()


def test_chunked_prefill_scores_the_prompt_as_one_prefill_does(embedded_model):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    whole = make_engine(embedded_model)
    chunked = make_engine(embedded_model, **CHUNKED)
    try:
        expected, _ = generate(whole, params)
        actual, _ = generate(chunked, params)
        for rid, outs in actual.items():
            got = outs[0].prompt_logprobs
            want = expected[rid][0].prompt_logprobs
            assert got is not None and want is not None and len(got) == len(want)
            assert got[0] is None and want[0] is None
            for g, w in zip(got[1:], want[1:], strict=True):
                assert g is not None and w is not None and g.token_id == w.token_id
                assert abs(g.logprob - w.logprob) < 1e-4
                assert [i for i, _ in g.top] == [i for i, _ in w.top]
    finally:
        whole.shutdown()
        chunked.shutdown()


def test_image_prompts_are_spliced_chunk_by_chunk(embedded_model):
    settings = {"max_model_len": 128}
    whole = make_engine(embedded_model, **settings)
    chunked = make_engine(embedded_model, max_num_batched_tokens=7, **settings)
    try:
        requests = {"img": (image_prompt(whole, "What is shown?"), [image(1)])}
        assert generate_with_images(chunked, requests) == generate_with_images(whole, requests)
    finally:
        whole.shutdown()
        chunked.shutdown()


def test_a_prompt_ending_in_an_image_keeps_its_last_image_token_a_prefill(embedded_model):
    # With a budget of n - 1 the last prompt token is left alone for a second step; it is an
    # image placeholder, which only the prefill path splices.
    whole = make_engine(embedded_model, max_model_len=128)
    vision = whole.vision
    ids = whole.tokenizer.encode("Describe this:") + [vision.image_token_id]
    prompt = expand_image_tokens(ids, vision.image_token_id, vision.num_tokens_per_image, 1)
    chunked = make_engine(embedded_model, max_model_len=128, max_num_batched_tokens=len(prompt) - 1)
    try:
        requests = {"img": (prompt, [image(2)])}
        assert generate_with_images(chunked, requests) == generate_with_images(whole, requests)
    finally:
        whole.shutdown()
        chunked.shutdown()
