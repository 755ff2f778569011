"""/v1/completions with several prompts: one choice per prompt, in prompt order, each its own
engine request; streamed chunks carry their choice's index; usage sums over prompts; a prompt
that is refused keeps every prompt of its request out of the engine."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from openai import OpenAI

from graphguard.server.protocol import MAX_PROMPTS_PER_REQUEST

from .helpers import MODEL, RunningServer

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 4}
KV_USED = "graphguard_server_kv_blocks_used"


def _single_texts(client: OpenAI, prompts: list[Any]) -> list[str]:
    return [client.completions.create(prompt=p, **GREEDY).choices[0].text for p in prompts]


def _post(server: RunningServer, **fields: Any) -> httpx.Response:
    # json.dumps escapes what httpx's encoder would refuse to send (a lone surrogate).
    body = json.dumps({"model": MODEL, "max_tokens": 2, **fields})
    headers = {"content-type": "application/json"}
    return httpx.post(
        f"{server.base_url}/v1/completions", content=body, headers=headers, timeout=60
    )


def test_text_prompts_get_one_choice_each_in_prompt_order(client: OpenAI) -> None:
    reply = client.completions.create(prompt=PROMPTS, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == _single_texts(client, PROMPTS)
    assert reply.choices[0].text.startswith(" Paris")
    assert reply.choices[1].text.startswith(" 5,")
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]


def test_token_id_prompts_answer_as_their_texts(client: OpenAI, server: RunningServer) -> None:
    ids = [server.tokenizer.encode(p) for p in PROMPTS]
    batched = client.completions.create(prompt=ids, **GREEDY)
    assert [c.text for c in batched.choices] == _single_texts(client, PROMPTS)
    one = client.completions.create(prompt=ids[1], **GREEDY)  # a flat list is one prompt
    assert [c.text for c in one.choices] == [batched.choices[1].text]


def test_usage_sums_over_the_prompts(client: OpenAI, server: RunningServer) -> None:
    reply = client.completions.create(prompt=PROMPTS, extra_body={"ignore_eos": True}, **GREEDY)
    num_prompt = sum(len(server.tokenizer.encode(p)) for p in PROMPTS)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == num_prompt
    assert reply.usage.completion_tokens == 2 * GREEDY["max_tokens"]
    assert reply.usage.total_tokens == num_prompt + 2 * GREEDY["max_tokens"]


def test_streamed_chunks_carry_their_choice_index_and_each_choice_finishes(
    server: RunningServer, client: OpenAI
) -> None:
    body = {"prompt": PROMPTS, "stream": True, "stream_options": {"include_usage": True}}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json={**GREEDY, **body}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    *chunks, usage_chunk = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]].append(choice)
    texts = ["".join(c["text"] for c in by_index[i]) for i in (0, 1)]
    assert texts == _single_texts(client, PROMPTS)
    for choices in by_index.values():  # each choice's last chunk, and only it, finishes
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == "length"


def test_echo_scores_each_prompt_as_it_does_alone(client: OpenAI) -> None:
    # What lm-eval's loglikelihood requests send: echo, one token, one logprob.
    score = {"model": MODEL, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    batched = client.completions.create(prompt=PROMPTS, **score)
    for prompt, choice in zip(PROMPTS, batched.choices, strict=True):
        alone = client.completions.create(prompt=prompt, **score).choices[0]
        assert choice.text.startswith(prompt) and choice.text == alone.text
        assert choice.logprobs is not None and alone.logprobs is not None
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.text_offset == alone.logprobs.text_offset
        assert choice.logprobs.token_logprobs is not None
        assert alone.logprobs.token_logprobs is not None
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            alone.logprobs.token_logprobs[1:], abs=1e-3
        )


def test_one_seed_draws_the_same_sample_for_every_prompt(client: OpenAI) -> None:
    # Documented: the seed applies to each prompt's request, as OpenAI applies one seed.
    reply = client.completions.create(
        model=MODEL, prompt=["Once upon a time"] * 2, temperature=1.0, seed=7, max_tokens=8
    )
    assert reply.choices[0].text == reply.choices[1].text


# (id, prompt, other fields, words the message must hold)
BAD_PROMPTS: list[tuple[str, Any, dict[str, Any], str]] = [
    ("empty_list", [], {}, "empty"),
    ("empty_text_in_list", ["Hello", ""], {}, "prompt 1 must not be empty"),
    ("empty_ids_in_list", [[1, 2], []], {}, "prompt 1 must not be empty"),
    ("mixed_text_and_ids", ["Hello", 42], {}, "no mixing"),
    ("mixed_ids_and_id_lists", [1, [2, 3]], {}, "no mixing"),
    ("bool_token_in_list", [[1, True]], {}, "token ids"),
    ("token_id_out_of_vocab", [[1, 2], [3, 10**9]], {}, "prompt 1: Token ids must be in"),
    ("too_many", ["Hi"] * (MAX_PROMPTS_PER_REQUEST + 1), {}, f"at most {MAX_PROMPTS_PER_REQUEST}"),
    ("too_long", ["Hello", "hello " * 1100], {}, "prompt 1: This model's maximum context"),
    ("lone_surrogate", ["Hello", "a\udc00"], {}, "prompt 1: text holds a lone"),
]


@pytest.mark.parametrize(
    ("prompt", "fields", "words"), [pytest.param(*case[1:], id=case[0]) for case in BAD_PROMPTS]
)
def test_a_bad_prompt_in_a_list_is_a_400_naming_prompt(
    server: RunningServer, prompt: Any, fields: dict[str, Any], words: str
) -> None:
    generated_before = server.engine.stats()["num_generated_tokens"]
    response = _post(server, prompt=prompt, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and words in error["message"]
    assert server.engine.stats()["num_generated_tokens"] == generated_before


def test_as_many_prompts_as_the_cap_are_answered(server: RunningServer) -> None:
    response = _post(server, prompt=[[42]] * MAX_PROMPTS_PER_REQUEST, max_tokens=1)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(MAX_PROMPTS_PER_REQUEST))


def test_a_prompt_the_engine_refuses_keeps_the_others_out_of_the_engine(
    server: RunningServer,
) -> None:
    # The second prompt fits the context (1024) but not the KV pool (1008 tokens): only the
    # engine refuses it, after the first was added; the first must not run either.
    baseline = server.sample(KV_USED)
    generated_before = server.engine.stats()["num_generated_tokens"]
    long_ids = [42] * 1000
    response = _post(server, prompt=[[42, 43], long_ids], max_tokens=20, ignore_eos=True)
    assert response.status_code == 400, response.text
    assert "KV blocks" in response.json()["error"]["message"]
    time.sleep(0.5)  # time for a first prompt left in the engine to make tokens (~25 ms each)
    assert server.engine.stats()["num_generated_tokens"] == generated_before
    assert server.sample(KV_USED) == baseline
    assert _post(server, prompt=PROMPTS).status_code == 200  # and the server keeps serving
