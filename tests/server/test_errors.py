"""Bad input gets a 4xx with an OpenAI error body, and the server answers the next request."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from graphguard.engine.tokens.limits import MAX_STOP_STRINGS
from graphguard.server.errors import APIError, error_response

from .helpers import CHAT, COMPLETIONS, MODEL, RunningServer

HELLO = [{"role": "user", "content": "Hello"}]


def _chat(**fields: Any) -> str:
    return json.dumps({"model": MODEL, "messages": HELLO, **fields})


def _completion(**fields: Any) -> str:
    return json.dumps({"model": MODEL, "prompt": "Hello", **fields})


def _with_literal(body: str, key: str, literal: str) -> str:
    """`body` with `"key": literal` added, for values json.dumps will not write (NaN)."""
    return body[:-1] + f', "{key}": {literal}}}'


# (id, endpoint, raw JSON body, expected status, expected param)
BAD_REQUESTS = [
    ("malformed_json", CHAT, '{"model": "x", "messages": [', 400, None),
    ("body_not_an_object", CHAT, "[1, 2, 3]", 400, None),
    ("missing_messages", CHAT, json.dumps({"model": MODEL}), 400, "messages"),
    ("messages_wrong_type", CHAT, _chat(messages="hello"), 400, "messages"),
    ("max_tokens_wrong_type", COMPLETIONS, _completion(max_tokens="many"), 400, "max_tokens"),
    ("temperature_wrong_type", CHAT, _chat(temperature="hot"), 400, "temperature"),
    ("unknown_model", CHAT, _chat(model="gpt-17"), 404, "model"),
    ("empty_messages", CHAT, _chat(messages=[]), 400, "messages"),
    ("empty_prompt", COMPLETIONS, _completion(prompt=""), 400, "prompt"),
    ("prompt_too_long", COMPLETIONS, _completion(prompt="hello " * 1100), 400, "prompt"),
    (
        "chat_too_long",
        CHAT,
        _chat(messages=[{"role": "user", "content": "hi " * 1100}]),
        400,
        "messages",
    ),
    ("max_tokens_zero", COMPLETIONS, _completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens_negative", CHAT, _chat(max_tokens=-5), 400, "max_tokens"),
    ("chat_max_tokens_zero", CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    (
        "max_completion_tokens_zero",
        CHAT,
        _chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("max_tokens_past_context", COMPLETIONS, _completion(max_tokens=5000), 400, "max_tokens"),
    ("temperature_above_2", CHAT, _chat(temperature=2.5), 400, "temperature"),
    ("temperature_negative", COMPLETIONS, _completion(temperature=-0.1), 400, "temperature"),
    ("top_p_zero", CHAT, _chat(top_p=0), 400, "top_p"),
    ("top_p_above_1", COMPLETIONS, _completion(top_p=1.5), 400, "top_p"),
    (
        "temperature_nan",
        CHAT,
        _with_literal(_chat(), "temperature", "NaN"),
        400,
        "temperature",
    ),
    (
        "top_p_infinity",
        COMPLETIONS,
        _with_literal(_completion(), "top_p", "Infinity"),
        400,
        "top_p",
    ),
    ("n_above_the_cap", CHAT, _chat(n=65), 400, "n"),
    ("n_above_max_num_seqs", CHAT, _chat(n=17), 400, "n"),
    ("prompts_times_n_above_the_cap", COMPLETIONS, _completion(prompt=["a"] * 8, n=9), 400, "n"),
    ("n_zero", COMPLETIONS, _completion(n=0), 400, "n"),
    ("token_id_out_of_vocab", COMPLETIONS, _completion(prompt=[1, 10**9]), 400, "prompt"),
    ("too_many_stops", COMPLETIONS, _completion(stop=["a"] * (MAX_STOP_STRINGS + 1)), 400, "stop"),
    (
        "unknown_role",
        CHAT,
        _chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages.0.role",
    ),
    ("presence_penalty_above_2", CHAT, _chat(presence_penalty=2.5), 400, "presence_penalty"),
    (
        "frequency_penalty_below_-2",
        COMPLETIONS,
        _completion(frequency_penalty=-3),
        400,
        "frequency_penalty",
    ),  # fmt: skip
    ("top_logprobs_without_logprobs", CHAT, _chat(top_logprobs=3), 400, "top_logprobs"),
    ("top_logprobs_above_20", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("completion_logprobs_above_5", COMPLETIONS, _completion(logprobs=6), 400, "logprobs"),
    ("completion_logprobs_true", COMPLETIONS, _completion(logprobs=True), 400, "logprobs"),
    ("logit_bias_above_100", COMPLETIONS, _completion(logit_bias={"42": 101}), 400, "logit_bias"),
    ("logit_bias_not_a_token_id", CHAT, _chat(logit_bias={"x": 1}), 400, "logit_bias"),
    ("logit_bias_past_the_vocab", CHAT, _chat(logit_bias={"49152": 1}), 400, "logit_bias"),
    ("logit_bias_string_value", CHAT, _chat(logit_bias={"42": "5"}), 400, "logit_bias.42"),
    (
        "tools_with_one_name_twice",
        CHAT,
        _chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2),
        400,
        "tools",
    ),  # fmt: skip
    ("tool_choice_required_without_tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    (
        "response_format_unknown_type",
        CHAT,
        _chat(response_format={"type": "yaml"}),
        400,
        "response_format",
    ),
    (
        "response_format_bad_schema",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "tree"}},
            }
        ),
        400,
        "response_format",
    ),
    (
        "response_format_dangling_ref",
        COMPLETIONS,
        _completion(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}},
            }
        ),
        400,
        "response_format",
    ),
    ("suffix", COMPLETIONS, _completion(suffix="end"), 400, "suffix"),
    ("best_of", COMPLETIONS, _completion(best_of=3), 400, "best_of"),
    # Text that is not valid Unicode: JSON escapes can carry a lone UTF-16 surrogate, which the
    # tokenizer (TypeError) and the response encoder (UnicodeEncodeError) cannot take.
    ("prompt_lone_surrogate", COMPLETIONS, _completion(prompt="\ud800"), 400, "prompt"),
    ("prompt_list_lone_surrogate", COMPLETIONS, _completion(prompt=["a\udc00"]), 400, "prompt"),
    ("model_lone_surrogate", CHAT, _chat(model="\ud800"), 400, "model"),
    ("stop_lone_surrogate", COMPLETIONS, _completion(stop=["\ud800"]), 400, "stop"),
    (
        "content_lone_surrogate",
        CHAT,
        _chat(messages=[{"role": "user", "content": "hi \ud800"}]),
        400,
        "messages.0.content",
    ),
    # Integers and booleans are strict, as in the OpenAI API.
    ("max_tokens_true", COMPLETIONS, _completion(max_tokens=True), 400, "max_tokens"),
    ("chat_max_tokens_fraction", CHAT, _chat(max_tokens=2.5), 400, "max_tokens"),
    ("stream_string", CHAT, _chat(stream="yes"), 400, "stream"),
    ("stream_one", COMPLETIONS, _completion(stream=1), 400, "stream"),
    ("echo_string", COMPLETIONS, _completion(echo="true"), 400, "echo"),
    ("chat_logprobs_one", CHAT, _chat(logprobs=1), 400, "logprobs"),
    ("n_true", CHAT, _chat(n=True), 400, "n"),
    ("seed_string", COMPLETIONS, _completion(seed="7"), 400, "seed"),
    ("temperature_true", CHAT, _chat(temperature=True), 400, "temperature"),
    ("temperature_string", COMPLETIONS, _completion(temperature="0.5"), 400, "temperature"),
    ("prompt_token_true", COMPLETIONS, _completion(prompt=[True, 2]), 400, "prompt"),
    (
        "include_usage_string",
        CHAT,
        _chat(stream=True, stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
    ),
    # A seed is a signed 64-bit integer; torch's generator would overflow past it.
    ("seed_above_int64", COMPLETIONS, _completion(seed=1 << 63), 400, "seed"),
    ("seed_below_int64", CHAT, _chat(seed=-(1 << 63) - 1), 400, "seed"),
    # top_p is compared in float32, where this one is 0: it would keep no token.
    ("top_p_zero_in_float32", CHAT, _chat(top_p=7e-46), 400, "top_p"),
    ("top_p_zero_in_float32_completions", COMPLETIONS, _completion(top_p=1e-300), 400, "top_p"),
    (
        "max_tokens_disagree",
        CHAT,
        _chat(max_tokens=5, max_completion_tokens=3),
        400,
        "max_completion_tokens",
    ),
]


def _post(server: RunningServer, path: str, body: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=30)


def _good_request_succeeds(server: RunningServer) -> bool:
    response = _post(server, COMPLETIONS, _completion(max_tokens=1))
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("endpoint", "body", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request_gets_openai_error_and_server_keeps_serving(
    server: RunningServer, endpoint: str, body: str, status: int, param: str | None
) -> None:
    response = _post(server, endpoint, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    assert _good_request_succeeds(server)


def test_engine_value_error_becomes_a_400(server: RunningServer) -> None:
    # Fits the context (1024) but not the KV pool (63 blocks x 16 = 1008 tokens): only the
    # engine's own admission check can refuse it.
    response = _post(server, COMPLETIONS, _completion(max_tokens=1010))
    assert response.status_code == 400, response.text
    assert "KV blocks" in response.json()["error"]["message"]
    assert _good_request_succeeds(server)


def test_unknown_path_gets_an_openai_style_404(server: RunningServer) -> None:
    response = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_openai_client_sees_bad_request_as_its_error_type(server: RunningServer) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        server.openai().chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert raised.value.status_code == 400
    assert _good_request_succeeds(server)


# The "off" values of the unimplemented fields, as clients and SDKs send them by default.
ASKS_FOR_NOTHING = [
    (CHAT, _chat(max_tokens=1, logprobs=False, top_logprobs=0, logit_bias={}, tools=[],
                 tool_choice="none", response_format={"type": "text"}, presence_penalty=0,
                 frequency_penalty=0, user="someone")),
    (COMPLETIONS, _completion(max_tokens=1, logprobs=None, echo=None, suffix="", best_of=1)),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body"), ASKS_FOR_NOTHING, ids=["chat", "completions"])
def test_unimplemented_fields_at_their_off_values_are_accepted(
    server: RunningServer, endpoint: str, body: str
) -> None:
    response = _post(server, endpoint, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_numbers_may_be_json_integers(server: RunningServer) -> None:
    # OpenAI's numbers (temperature, top_p, penalties) take 1 as readily as 1.0.
    body = _completion(max_tokens=1, temperature=1, top_p=1, frequency_penalty=1, seed=-1)
    response = _post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text


def test_seeds_at_the_int64_bounds_are_accepted(server: RunningServer) -> None:
    for seed in (-(1 << 63), (1 << 63) - 1):
        response = _post(server, COMPLETIONS, _completion(max_tokens=1, seed=seed))
        assert response.status_code == 200, response.text


def test_the_smallest_positive_top_p_in_float32_is_accepted(server: RunningServer) -> None:
    response = _post(server, COMPLETIONS, _completion(max_tokens=2, top_p=1.5e-45))
    assert response.status_code == 200, response.text


def test_a_positive_temperature_too_small_to_divide_by_samples_greedily(
    server: RunningServer,
) -> None:
    # 5e-324 is 0 in float32; the engine takes the argmax below GREEDY_BELOW_TEMPERATURE.
    def text(temperature: float) -> str:
        body = _completion(max_tokens=6, temperature=temperature, ignore_eos=True)
        response = _post(server, COMPLETIONS, body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    assert text(5e-324) == text(0)


def test_max_tokens_and_max_completion_tokens_that_agree_are_accepted(
    server: RunningServer,
) -> None:
    body = _chat(max_tokens=2, max_completion_tokens=2, ignore_eos=True)
    response = _post(server, CHAT, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_an_error_quoting_a_lone_surrogate_still_renders() -> None:
    # The last line of defence behind the request checks: the message spells the character out.
    response = error_response(APIError(404, "The model '\ud800' does not exist."))
    assert (
        json.loads(bytes(response.body))["error"]["message"]
        == "The model '\\ud800' does not exist."
    )


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(
    server: RunningServer, endpoint: str
) -> None:
    info = server.engine.info
    most = info.max_model_len * info.tokenizer.max_token_chars  # the bound the server uses
    text = "a" * (most + 1)
    body = (
        _completion(prompt=text)
        if endpoint == COMPLETIONS
        else _chat(messages=[{"role": "user", "content": text}])
    )
    response = _post(server, endpoint, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert error["param"] == ("prompt" if endpoint == COMPLETIONS else "messages")


def test_more_messages_than_the_context_has_tokens_are_refused(server: RunningServer) -> None:
    many = [{"role": "user", "content": "hi"}] * (server.engine.info.max_model_len + 1)
    response = _post(server, CHAT, _chat(messages=many))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "messages cannot fit" in error["message"]
