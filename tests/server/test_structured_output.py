"""Structured output and logit_bias through the official client, with the real model: the text
of a `response_format` request parses as JSON and matches its schema; logit_bias moves tokens
as OpenAI's does; none of it leaves a KV block or sequence behind."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai import OpenAI

from .helpers import MODEL, RunningServer, wait_for

KV_USED = "graphguard_server_kv_blocks_used"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "is_capital": {"type": "boolean"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "is_capital", "rank"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def _json_schema(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _matches_city(text: str) -> bool:
    """Whether `text` is a JSON document that validates against CITY."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(document, dict)
        and set(document) == {"city", "is_capital", "rank"}
        and document["city"] in {"Paris", "Lyon", "Nice"}
        and isinstance(document["is_capital"], bool)
        and type(document["rank"]) is int
        and 1 <= document["rank"] <= 9
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_output_parses_and_matches_the_schema(
    client: OpenAI, server: RunningServer, temperature: float
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        response_format=_json_schema(CITY),
        temperature=temperature,
        seed=5,
        max_tokens=64,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # the grammar's end, well before max_tokens
    assert _matches_city(choice.message.content or ""), choice.message.content
    assert wait_for(lambda: server.sample(KV_USED) == 0, timeout_s=5)


def test_json_object_output_is_a_json_object(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat in JSON with a name."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=96,
        logit_bias={"0": -100},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_the_same_request_without_the_schema_does_not_match_it(client: OpenAI) -> None:
    # The control of the schema tests: unconstrained, the model answers {"city": "Paris"}.
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=64
    )
    assert not _matches_city(reply.choices[0].message.content or "")


def test_streamed_json_schema_choices_each_match_the_schema(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        response_format=_json_schema(CITY),
        n=2,
        temperature=1.0,
        seed=9,
        max_tokens=64,
        stream=True,
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(_matches_city(text) for text in texts), texts


def test_completions_take_a_response_format_too(client: OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="The capital of France as JSON:",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": _json_schema(CITY)},
    )
    assert _matches_city(reply.choices[0].text), reply.choices[0].text


def test_logit_bias_of_minus_100_bans_the_greedy_token(
    client: OpenAI, server: RunningServer
) -> None:
    greedy: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is"}
    plain = client.completions.create(max_tokens=1, temperature=0, logprobs=0, **greedy)
    assert plain.choices[0].text == " Paris"
    (paris,) = server.tokenizer.encode(" Paris")
    banned = client.completions.create(
        max_tokens=1, temperature=0, logit_bias={str(paris): -100}, **greedy
    )
    assert banned.choices[0].text not in ("", " Paris")


def test_logit_bias_of_100_forces_a_token(client: OpenAI, server: RunningServer) -> None:
    (token,) = server.tokenizer.encode(" banana")
    reply = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=1.0,
        logit_bias={str(token): 100},
    )
    assert reply.choices[0].text == " banana" * 3


def test_a_bad_schema_is_a_400_naming_response_format_and_leaves_nothing(
    client: OpenAI, server: RunningServer
) -> None:
    before = server.engine.stats()["num_generated_tokens"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            response_format=_json_schema({"type": "object", "properties": {"a": {"type": 7}}}),
        )
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
    assert server.engine.stats()["num_generated_tokens"] == before
    assert server.engine.stats()["num_running"] == 0 and server.engine.stats()["num_waiting"] == 0
