"""Schemathesis over the server's own OpenAPI document: generated requests, valid ones and
ones that break the document's request schemas, get no 5xx, and every response conforms to
the document (its status is listed, its content type and body match the listed schema); and
valid requests to the generation and tokenizer routes are mostly answered, not refused, since
the document states what validation takes.

Bounded for the suite: a few dozen examples per operation and mode (a dozen valid requests to
each generation route, whose answers cost most of the run), against a server whose context
is small, with valid requests capped to a few generated tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode

from graphguard.engine.config import EngineConfig
from graphguard.engine.engine import LLMEngine
from graphguard.server.vllm_fields import OUTPUT_CONSTRAINTS

from .conftest import engine_sharing_weights, serve
from .helpers import MODEL, RunningServer

API_KEY = "sk-fuzz-0123456789"
# the constraints of vLLM's `structured_outputs` object, by their JSON names
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
GRAMMAR = 'start: "yes" | "no"'
VOCAB_SIZE = 49152  # the embedded model's
# Room for a short conversation (the chat template adds about 30 tokens, an offered tool about
# 90) and a few generated tokens.
FUZZ_ENGINE = EngineConfig(max_model_len=384, max_num_seqs=8, num_kv_blocks=96)
# What one valid request may generate: choices (`n`) and tokens per choice.
MAX_GENERATED_TOKENS = 4
MAX_MESSAGES, MAX_TEXT_CHARS = 4, 32  # a conversation that fits FUZZ_ENGINE's context
CAPS = {"n": 2, "max_tokens": MAX_GENERATED_TOKENS, "max_completion_tokens": MAX_GENERATED_TOKENS}
# Per operation and mode: the whole run takes about twenty seconds. A longer hunt:
# GRAPHGUARD_FUZZ_EXAMPLES=500 pytest tests/server/test_openapi_fuzz.py
FUZZ_EXAMPLES = os.environ.get("GRAPHGUARD_FUZZ_EXAMPLES")
MAX_EXAMPLES = int(FUZZ_EXAMPLES or 25)
# Valid requests to the generation routes are each answered by the engine (about half a second
# on a 2-core CPU), so they take fewer examples; a dozen still give the answered share weight.
GENERATING = {"/v1/completions", "/v1/chat/completions"}
MAX_GENERATING_EXAMPLES = int(FUZZ_EXAMPLES or 12)
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/v1/graphs"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
]
WITH_INPUT = [(method, path) for method, path in OPERATIONS if method == "POST"]  # negative mode
# Operations whose valid requests should mostly be answered, not refused: the document states
# what validation takes, so only what it cannot state (a prompt too long for the context) is
# a 400 here.
ANSWERED = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
MIN_ANSWERED_SHARE = 0.8
CHECKS = {
    "not_a_server_error": {},
    "status_code_conformance": {},
    "content_type_conformance": {},
    "response_schema_conformance": {},
    "response_headers_conformance": {},
    "negative_data_rejection": {},
    "ignored_auth": {},
    # Valid by the document is not always accepted: an unknown model id is a 404, a prompt
    # longer than the context a 400. The status and body of those answers are still checked.
    "positive_data_acceptance": {"enabled": False},
}


@pytest.fixture(scope="module")
def fuzzed(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(engine_sharing_weights(engine, FUZZ_ENGINE), FUZZ_ENGINE, api_key=API_KEY)


@pytest.fixture(scope="module")
def api_schema(fuzzed: RunningServer) -> Any:
    config = schemathesis.Config.from_dict(
        {"headers": {"Authorization": f"Bearer {API_KEY}"}, "checks": CHECKS}
    )
    return schemathesis.openapi.from_url(f"{fuzzed.base_url}/openapi.json", config=config)


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS]
    + [(method, path, GenerationMode.NEGATIVE) for method, path in WITH_INPUT],
)
def test_no_request_gets_a_5xx_and_every_response_is_as_documented(
    api_schema: Any, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]
    statuses: list[int] = []
    refusals: list[str] = []  # what the failure message shows

    @hypothesis.settings(
        max_examples=max_examples(path, mode),
        deadline=None,
        database=None,
        derandomize=True,  # the same examples on every run
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        _aim_at_the_engine(case, mode)
        response = case.call_and_validate(timeout=60)
        statuses.append(response.status_code)
        if response.status_code != 200:
            refusals.append(response.text[:300])

    fuzz()
    if mode is GenerationMode.POSITIVE and path in ANSWERED:
        # NOTE: hypothesis replays a failing example; a run that gets here recorded each once.
        assert statuses.count(200) >= MIN_ANSWERED_SHARE * len(statuses), refusals


def max_examples(path: str, mode: GenerationMode) -> int:
    """How many requests one operation and mode is fuzzed with."""
    if mode is GenerationMode.POSITIVE and path in GENERATING:
        return MAX_GENERATING_EXAMPLES
    return MAX_EXAMPLES


def test_the_fuzz_covers_every_documented_operation(api_schema: Any) -> None:
    documented = {
        (method.upper(), path)
        for path, operations in api_schema.raw_schema["paths"].items()
        for method in operations
    }
    assert documented == set(OPERATIONS)


def _aim_at_the_engine(case: Any, mode: GenerationMode) -> None:
    """Aim a generation request at the served model, so that it gets past the model check to
    the engine; in positive mode, also keep what it generates small. A string stays a string
    and a valid count stays valid, so valid and invalid bodies stay so."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if mode is GenerationMode.POSITIVE:
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_GENERATED_TOKENS
        for name, cap in CAPS.items():
            if type(body.get(name)) in (int, float) and body[name] > cap:
                body[name] = cap
        if None not in (body.get("max_tokens"), body.get("max_completion_tokens")):
            body["max_completion_tokens"] = body["max_tokens"]  # the two names of one limit
        _fit_the_context(body)
        _fit_the_relations(body)


def _fit_the_context(body: dict[str, Any]) -> None:
    """What the document cannot state, made to hold: at most MAX_MESSAGES messages of at most
    MAX_TEXT_CHARS characters each fit the context, and image parts become text parts (a
    generated data URL is never a decodable image)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    del messages[MAX_MESSAGES:]
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls[:1] if isinstance(calls, list) else []:  # a call is prompt text too
            function = call.get("function") if isinstance(call, dict) else None
            for key, value in (function or {}).items():
                if isinstance(value, str):
                    function[key] = value[:MAX_TEXT_CHARS]  # type: ignore[index]
        if isinstance(calls, list):
            del calls[1:]
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            message["content"] = content[:MAX_TEXT_CHARS]
        for index, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                content[index] = {"type": "text", "text": "an image"}
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = part["text"][:MAX_TEXT_CHARS]


def _fit_the_relations(body: dict[str, Any]) -> None:
    """What the document cannot state about one field against another, made to hold: at most
    max_tokens min_tokens, one output constraint at most (in `structured_outputs` too), a
    continued last message the assistant's with text, a tool small enough for the context, a
    choice of one only where one is offered, a grammar that parses, and token ids within the
    vocabulary."""
    for name in [name for name in OUTPUT_CONSTRAINTS if name in body][1:]:
        del body[name]
    limit = body.get("max_tokens") or body.get("max_completion_tokens") or MAX_GENERATED_TOKENS
    if type(body.get("min_tokens")) in (int, float) and type(limit) in (int, float):
        body["min_tokens"] = min(body["min_tokens"], limit)
    inner = body.get("structured_outputs")
    if isinstance(inner, dict):  # one constraint inside it too
        for name in [name for name in STRUCTURED_OUTPUTS if inner.get(name)][1:]:
            del inner[name]
    for holder, name in ((body, "guided_grammar"), (inner, "grammar")):
        if isinstance(holder, dict) and isinstance(holder.get(name), str):
            holder[name] = GRAMMAR  # a grammar's syntax is the grammar engine's to check
    bias = body.get("logit_bias")
    if isinstance(bias, dict):  # the vocabulary's size is the model's, not the document's
        for key in [key for key in bias if key.isdigit() and int(key) >= VOCAB_SIZE]:
            del bias[key]
    messages = body.get("messages")
    if body.get("continue_final_message") is True and isinstance(messages, list) and messages:
        messages[-1] = {"role": "assistant", "content": "The answer is"}
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        if body.get("tool_choice") not in ("auto", "none"):
            body.pop("tool_choice", None)  # "required" and a named choice need a tool
        return
    del tools[1:]  # offered tools are prompt text: one small one fits the context
    for index, tool in enumerate(tools):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool["function"].update(name=f"tool_{index}", parameters={"type": "object"})
            tool["function"].pop("description", None)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and tools:
        choice["function"]["name"] = "tool_0"
