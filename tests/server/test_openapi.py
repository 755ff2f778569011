"""The OpenAPI document (/openapi.json) tells the truth: every status a route can answer is
listed, errors with the OpenAI error schema, generation answers with typed models, streams as
server-sent events, /metrics as plain text, and no 422 (validation errors are 400s)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from graphguard.engine.engine import LLMEngine
from graphguard.server import responses as r
from graphguard.server.app import build_app
from graphguard.server.config import ServerConfig
from graphguard.server.errors import APIError, error_body

from .helpers import RunningServer

ERROR_REF = "#/components/schemas/ErrorResponse"
# What each route can answer on a default (loopback, keyless) server: the Host check's 403 and
# the body limit's 413 and 408 on every route, then the route's own.
EXPECTED_STATUSES = {
    ("get", "/health"): {"200", "403", "408", "413", "503"},
    ("get", "/metrics"): {"200", "403", "408", "413"},
    ("get", "/v1/models"): {"200", "403", "408", "413"},
    ("get", "/v1/models/{model_id}"): {"200", "403", "404", "408", "413"},
    ("get", "/v1/graphs"): {"200", "403", "408", "413"},
    ("post", "/v1/completions"): {"200", "400", "403", "404", "408", "413", "503"},
    ("post", "/v1/chat/completions"): {"200", "400", "403", "404", "408", "413", "503"},
    ("post", "/tokenize"): {"200", "400", "403", "404", "408", "413"},
    ("post", "/detokenize"): {"200", "400", "403", "404", "408", "413"},
    ("get", "/tokenizer_info"): {"200", "403", "408", "413"},
}
GENERATION = {
    "/v1/completions": ("CompletionResponse", "CompletionResponse"),
    "/v1/chat/completions": ("ChatCompletionResponse", "ChatCompletionChunk"),
}


@pytest.fixture(scope="module")
def document(server: RunningServer) -> dict[str, Any]:
    return dict(httpx.get(f"{server.base_url}/openapi.json", timeout=10).json())


def _operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method, path): operation
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }


def _json_schema(response: dict[str, Any]) -> dict[str, Any]:
    return dict(response["content"]["application/json"]["schema"])


def test_each_route_documents_every_status_it_can_answer(document: dict[str, Any]) -> None:
    statuses = {key: set(op["responses"]) for key, op in _operations(document).items()}
    assert statuses == EXPECTED_STATUSES


def test_every_documented_error_has_the_openai_error_schema(document: dict[str, Any]) -> None:
    for key, operation in _operations(document).items():
        for status, response in operation["responses"].items():
            if status.startswith("4") or key[1] != "/health" and status.startswith("5"):
                assert _json_schema(response) == {"$ref": ERROR_REF}, (key, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_the_error_schema_is_what_the_server_sends() -> None:
    body = error_body(APIError(400, "bad", param="max_tokens", code="invalid_value"))
    assert r.ErrorResponse.model_validate(body).model_dump() == body


def test_generation_answers_are_typed_and_streams_are_server_sent_events(
    document: dict[str, Any],
) -> None:
    for path, (response_model, chunk) in GENERATION.items():
        ok = document["paths"][path]["post"]["responses"]["200"]
        assert _json_schema(ok) == {"$ref": f"#/components/schemas/{response_model}"}
        event = ok["content"]["text/event-stream"]["schema"]
        as_json, done = event["properties"]["data"]["anyOf"]
        assert {"$ref": f"#/components/schemas/{chunk}"} in as_json["contentSchema"]["anyOf"]
        assert done["const"] == "[DONE]"
        assert chunk in document["components"]["schemas"]


def test_metrics_are_documented_as_plain_text(document: dict[str, Any]) -> None:
    content = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]


def test_the_other_routes_answer_typed_models(document: dict[str, Any]) -> None:
    operations = _operations(document)
    for key, model in [
        (("get", "/health"), "Health"),
        (("get", "/v1/models"), "ModelList"),
        (("get", "/v1/models/{model_id}"), "ModelCard"),
        (("get", "/v1/graphs"), "GraphsReport"),
        (("post", "/tokenize"), "TokenizeResponse"),
        (("post", "/detokenize"), "DetokenizeResponse"),
        (("get", "/tokenizer_info"), "TokenizerInfo"),
    ]:
        assert _json_schema(operations[key]["responses"]["200"])["$ref"].endswith(f"/{model}")


def test_with_an_api_key_the_guarded_routes_document_bearer_auth_and_401(
    engine: LLMEngine,
) -> None:
    keyed = build_app(engine, ServerConfig(api_key="sk-doc")).openapi()
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for (_, path), operation in _operations(keyed).items():
        is_open = path in ("/health", "/metrics")
        assert ("401" in operation["responses"]) is not is_open, path
        assert ("security" in operation) is not is_open, path


def test_a_server_on_any_host_documents_no_host_check(engine: LLMEngine) -> None:
    anywhere = build_app(engine, ServerConfig(host="0.0.0.0")).openapi()
    assert all("403" not in op["responses"] for op in _operations(anywhere).values())
