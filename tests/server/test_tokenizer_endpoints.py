"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) answer as vLLM does,
with the server's own tokenizer, behind the same API key and Host checks as the rest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from graphguard.engine.engine import LLMEngine
from graphguard.engine.tokens.tokenizer import Tokenizer

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import MODEL, QUESTION, RunningServer

API_KEY = "sk-tokenize-0123456789"


def _post(server: RunningServer, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30, **kw)


def _tokens(server: RunningServer, body: dict[str, Any]) -> list[int]:
    response = _post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


@pytest.fixture(scope="module")
def tokenizer(engine: LLMEngine) -> Tokenizer:
    return engine.tokenizer


@pytest.fixture(scope="module")
def keyed(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(engine_sharing_weights(engine), TEST_ENGINE, api_key=API_KEY)


def test_tokenize_a_prompt_answers_the_tokens_their_count_and_the_context(
    server: RunningServer,
    tokenizer: Tokenizer,
) -> None:
    text = "The capital of France is"
    response = _post(server, "/tokenize", {"prompt": text, "model": MODEL})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == TEST_ENGINE.max_model_len
    assert body["token_strs"] is None


def test_tokenize_returns_token_texts_when_asked(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    body = {"prompt": "The capital<|im_end|>", "return_token_strs": True}
    answer = _post(server, "/tokenize", body).json()
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in answer["tokens"]]
    assert answer["token_strs"] == texts and texts[-1] == "<|im_end|>"


def test_tokenize_messages_counts_the_prompt_a_chat_completion_runs(
    server: RunningServer,
) -> None:
    with_prompt = _tokens(server, {"messages": QUESTION})
    without = _tokens(server, {"messages": QUESTION, "add_generation_prompt": False})
    chat = server.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert chat.usage is not None and len(with_prompt) == chat.usage.prompt_tokens
    # The generation prompt opens the assistant's turn: the same conversation, plus its opening.
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)


def test_add_special_tokens_false_keeps_a_control_token_text_one_token(
    server: RunningServer,
) -> None:
    assert _tokens(server, {"prompt": "<|im_end|>", "add_special_tokens": False}) == [2]


def test_tokenize_needs_exactly_one_of_prompt_and_messages(server: RunningServer) -> None:
    for body in ({}, {"prompt": "a", "messages": QUESTION}):
        response = _post(server, "/tokenize", body)
        assert response.status_code == 400, response.text
        assert "prompt" in response.json()["error"]["message"]


CONTINUED = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


GREETING = "{{ greeting }}{% for m in messages %}{{ m.content }}|{% endfor %}"


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        (
            "continue_final_message",
            {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False},
        ),
        ("chat_template", {"chat_template": GREETING}),
        (
            "chat_template_kwargs",
            {"chat_template": GREETING, "chat_template_kwargs": {"greeting": "Hi!"}},
        ),
        ("tools", {"tools": [TOOL]}),
    ],
)
def test_tokenize_renders_vllms_template_fields_as_a_chat_completion_does(
    server: RunningServer, field: str, fields: dict[str, Any]
) -> None:
    body = {"messages": QUESTION, **fields}
    counted = _tokens(server, body)
    without = {name: value for name, value in body.items() if name != field}
    assert len(counted) != len(_tokens(server, without))  # the field matters
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=body.pop("messages"), max_tokens=1, extra_body=body
    )
    assert chat.usage is not None and len(counted) == chat.usage.prompt_tokens


def test_tokenize_with_another_model_is_a_404(server: RunningServer) -> None:
    response = _post(server, "/tokenize", {"prompt": "a", "model": "gpt-17"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_detokenize_spells_control_tokens_out(server: RunningServer, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Paris.") + [2]
    response = _post(server, "/detokenize", {"tokens": ids, "model": MODEL})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": "Paris.<|im_end|>"}


def test_detokenize_takes_ids_written_as_whole_floats(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("Paris")
    response = _post(server, "/detokenize", {"tokens": [float(t) for t in ids]})
    assert response.json() == {"prompt": "Paris"}


@pytest.mark.parametrize("token", [49152, -1, 1.5, True])
def test_detokenize_refuses_what_is_no_token_of_the_vocabulary(
    server: RunningServer, token: Any
) -> None:
    response = _post(server, "/detokenize", {"tokens": [1, token]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("tokens")


def test_tokenizer_info_names_the_special_tokens_with_their_ids(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    response = httpx.get(f"{server.base_url}/tokenizer_info", timeout=10)
    assert response.status_code == 200, response.text
    info = response.json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == 2
    assert info["bos_token"] == "<|im_start|>" and info["bos_token_id"] == 1
    assert info["eos_token_id"] in tokenizer.eos_token_ids
    assert "pad_token" in info and "pad_token_id" in info  # null: this tokenizer has none
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == TEST_ENGINE.max_model_len
    assert info["tokenizer_class"] == "Tokenizer" and info["name_or_path"] == MODEL


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
    ],
)
def test_the_tokenizer_endpoints_need_the_api_key(
    keyed: RunningServer, method: str, path: str, body: Any
) -> None:
    url = f"{keyed.base_url}{path}"
    refused = httpx.request(method, url, json=body, timeout=10)
    assert refused.status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.request(method, url, json=body, headers=auth, timeout=10).status_code == 200


def test_the_tokenizer_endpoints_check_the_host(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    for method, path in [("POST", "/tokenize"), ("GET", "/tokenizer_info")]:
        response = httpx.request(
            method,
            f"{server.base_url}{path}",
            json={"prompt": "a"},
            headers={"Host": "attacker.example"},
            timeout=10,
        )
        assert response.status_code == 403
