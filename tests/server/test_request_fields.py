"""Request fields as vLLM takes them: integers written as whole floats, `stop_token_ids`,
`top_k`, `max_completion_tokens` on /v1/completions, `stream_options` only with a stream,
unknown fields ignored and logged by a permissive server; and a 405 that names the allowed
methods."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from graphguard.engine.engine import LLMEngine
from graphguard.engine.tokens.tokenizer import Tokenizer

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import CHAT, COMPLETIONS, RunningServer, ok, post

Answer = dict[str, Any]


@pytest.fixture(scope="module")
def tokenizer(engine: LLMEngine) -> Tokenizer:
    return engine.tokenizer


def _post(server: RunningServer, path: str, **fields: Any) -> httpx.Response:
    return post(server, path, 60, **fields)


def _ok(server: RunningServer, path: str, **fields: Any) -> Answer:
    return ok(server, path, 60, **fields)


def _completion_tokens(answer: Answer) -> int:
    return int(answer["usage"]["completion_tokens"])


# (endpoint, fields with integers written as whole floats, what the answer shows of them)
WHOLE_FLOATS: list[tuple[str, dict[str, Any], Callable[[Answer], bool]]] = [
    (COMPLETIONS, {"max_tokens": 3.0}, lambda a: _completion_tokens(a) == 3),
    (COMPLETIONS, {"max_completion_tokens": 3.0}, lambda a: _completion_tokens(a) == 3),
    (COMPLETIONS, {"n": 2.0, "max_tokens": 1}, lambda a: len(a["choices"]) == 2),
    (
        COMPLETIONS,
        {"prompt": [4790.0, 28.0], "max_tokens": 1},
        lambda a: a["usage"]["prompt_tokens"] == 2,
    ),
    (COMPLETIONS, {"seed": 7.0, "max_tokens": 1}, lambda a: _completion_tokens(a) == 1),
    (COMPLETIONS, {"top_k": 1.0, "max_tokens": 1}, lambda a: _completion_tokens(a) == 1),
    (COMPLETIONS, {"best_of": 1.0, "max_tokens": 1}, lambda a: _completion_tokens(a) == 1),
    (
        COMPLETIONS,
        {"logprobs": 2.0, "max_tokens": 1},
        lambda a: len(a["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2,
    ),
    (COMPLETIONS, {"stop_token_ids": [2.0], "max_tokens": 1}, lambda a: _completion_tokens(a) == 1),
    (CHAT, {"max_tokens": 2.0}, lambda a: _completion_tokens(a) <= 2),
    (CHAT, {"max_completion_tokens": 2.0}, lambda a: _completion_tokens(a) <= 2),
    (CHAT, {"n": 2.0, "max_tokens": 1}, lambda a: len(a["choices"]) == 2),
    (
        CHAT,
        {"logprobs": True, "top_logprobs": 3.0, "max_tokens": 1},
        lambda a: len(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3,
    ),
]


@pytest.mark.parametrize(
    ("path", "fields", "shows"), WHOLE_FLOATS, ids=[str(sorted(f)) for _, f, _ in WHOLE_FLOATS]
)
def test_integers_written_as_whole_floats_are_those_integers(
    server: RunningServer, path: str, fields: dict[str, Any], shows: Callable[[Answer], bool]
) -> None:
    answer = _ok(server, path, ignore_eos=True, **fields)
    assert shows(answer), answer


INTEGER_FIELDS = [
    (COMPLETIONS, "max_tokens"),
    (COMPLETIONS, "max_completion_tokens"),
    (COMPLETIONS, "n"),
    (COMPLETIONS, "seed"),
    (COMPLETIONS, "logprobs"),
    (COMPLETIONS, "top_k"),
    (CHAT, "max_tokens"),
    (CHAT, "top_logprobs"),
    (CHAT, "n"),
]


@pytest.mark.parametrize("value", [2.5, True])
@pytest.mark.parametrize(("path", "field"), INTEGER_FIELDS)
def test_a_fraction_or_a_boolean_is_no_integer(
    server: RunningServer, path: str, field: str, value: Any
) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    response = _post(server, path, **{field: value}, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize(
    ("field", "value"), [("prompt", [4790, 2.5]), ("stop_token_ids", [2.5]), ("prompt", [True])]
)
def test_a_token_id_with_a_fraction_is_refused(
    server: RunningServer, field: str, value: Any
) -> None:
    response = _post(server, COMPLETIONS, **{field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stream_options_without_a_stream_are_refused(server: RunningServer, path: str) -> None:
    for stream in ({}, {"stream": False}):
        response = _post(server, path, stream_options={"include_usage": True}, **stream)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "stream_options"


def test_completions_generation_ends_at_a_stop_token_id_without_its_text(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    (comma,) = tokenizer.encode(",", add_special_tokens=False)
    fields = {"max_tokens": 6, "temperature": 0, "logprobs": 0}
    plain = _ok(server, COMPLETIONS, **fields)["choices"][0]
    assert plain["finish_reason"] == "length" and "," in plain["text"]
    stopped = _ok(server, COMPLETIONS, stop_token_ids=[comma], **fields)["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == plain["text"].split(",")[0]  # up to the token, not its text
    assert stopped["logprobs"]["tokens"][-1] == ","  # the token itself was generated


def test_chat_generation_ends_at_a_stop_token_id(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    fields = {"max_tokens": 12, "temperature": 0}
    content = _ok(server, CHAT, **fields)["choices"][0]["message"]["content"]
    first, second = tokenizer.encode(content, add_special_tokens=False)[:2]
    choice = _ok(server, CHAT, stop_token_ids=[second], **fields)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == tokenizer.decode([first])


def test_ignore_eos_does_not_ignore_stop_token_ids(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    (comma,) = tokenizer.encode(",", add_special_tokens=False)
    fields = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    choice = _ok(server, COMPLETIONS, stop_token_ids=[comma], **fields)["choices"][0]
    assert choice["finish_reason"] == "stop"


def test_a_stop_token_id_outside_the_vocabulary_is_refused(server: RunningServer) -> None:
    response = _post(server, CHAT, stop_token_ids=[1, 49152])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stop_token_ids"


def test_completions_honour_max_completion_tokens(server: RunningServer) -> None:
    answer = _ok(server, COMPLETIONS, max_completion_tokens=5, ignore_eos=True)
    assert _completion_tokens(answer) == 5
    same = _ok(server, COMPLETIONS, max_tokens=4, max_completion_tokens=4, ignore_eos=True)
    assert _completion_tokens(same) == 4


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2000}, "max_tokens"),  # past the context
    ],
)
def test_completions_refuse_a_max_completion_tokens_they_cannot_honour(
    server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    response = _post(server, COMPLETIONS, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_top_k_one_is_greedy(server: RunningServer) -> None:
    fields = {"max_tokens": 4, "ignore_eos": True}
    greedy = _ok(server, COMPLETIONS, temperature=0, **fields)["choices"][0]["text"]
    for seed in (1, 2, 3):
        top1 = _ok(server, COMPLETIONS, temperature=2, top_k=1, seed=seed, **fields)
        assert top1["choices"][0]["text"] == greedy


@pytest.fixture(scope="module")
def permissive(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(engine_sharing_weights(engine), TEST_ENGINE, permissive=True)


def test_a_permissive_server_ignores_unknown_fields_and_logs_them(
    permissive: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="graphguard.server"):
        answer = _ok(permissive, COMPLETIONS, max_tokens=1, frobnicate=3, user="someone")
    assert _completion_tokens(answer) == 1
    logged = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
    assert logged and "CompletionRequest" in logged[0] and "user" not in logged[0]


@pytest.mark.parametrize(
    ("method", "path", "allowed"), [("GET", COMPLETIONS, "POST"), ("POST", "/health", "GET")]
)
def test_a_405_names_the_allowed_methods(
    server: RunningServer, method: str, path: str, allowed: str
) -> None:
    response = httpx.request(method, f"{server.base_url}{path}", timeout=10)
    assert response.status_code == 405
    assert allowed in [m.strip() for m in response.headers["allow"].split(",")]
    assert response.json()["error"]["type"] == "invalid_request_error"
