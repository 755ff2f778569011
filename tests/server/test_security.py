"""Who may call the server: the Host check of a loopback bind (DNS rebinding) and the API key."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from graphguard.engine.engine import LLMEngine
from graphguard.server.config import ServerConfig

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import MODEL, RunningServer

API_KEY = "sk-test-0123456789"
EXTRA_HOST = "gpu-box.internal"


@pytest.fixture(scope="module")
def guarded(engine: LLMEngine) -> Iterator[RunningServer]:
    """A loopback server that needs API_KEY and also answers to EXTRA_HOST."""
    yield from serve(
        engine_sharing_weights(engine), TEST_ENGINE, api_key=API_KEY, allowed_hosts=(EXTRA_HOST,)
    )


def _get(server: RunningServer, path: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}{path}", headers=headers, timeout=30)


def _assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/nothing-here"])
def test_a_loopback_server_refuses_a_foreign_host_header(server: RunningServer, path: str) -> None:
    # What a page on evil.example sends once its name resolves to 127.0.0.1.
    response = _get(server, path, host="evil.example:8000")
    _assert_openai_error(response, 403, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1:8000", "[::1]:8000"])
def test_a_loopback_server_answers_loopback_host_names(server: RunningServer, host: str) -> None:
    assert _get(server, "/v1/models", host=host).status_code == 200


def test_allowed_hosts_widen_the_loopback_names(guarded: RunningServer) -> None:
    auth = {"authorization": f"Bearer {API_KEY}"}
    assert _get(guarded, "/v1/models", host=f"{EXTRA_HOST}:80", **auth).status_code == 200
    response = _get(guarded, "/v1/models", host="evil.example", **auth)
    _assert_openai_error(response, 403, "host_not_allowed")


def test_only_a_non_loopback_bind_without_allowed_hosts_answers_any_host() -> None:
    assert ServerConfig(host="0.0.0.0").allowed_host_names is None
    listed = ServerConfig(host="0.0.0.0", allowed_hosts=("api.example",)).allowed_host_names
    assert listed is not None and {"api.example", "localhost"} <= listed
    for loopback in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        names = ServerConfig(host=loopback).allowed_host_names
        assert names is not None and "evil.example" not in names


PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/graphs"),
    ("GET", "/docs"),
    ("GET", "/nothing-here"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {API_KEY}", API_KEY])
def test_without_the_key_every_route_but_health_and_metrics_is_a_401(
    guarded: RunningServer, method: str, path: str, authorization: str | None
) -> None:
    headers = {"authorization": authorization} if authorization else {}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1} if method == "POST" else None
    url = f"{guarded.base_url}{path}"
    response = httpx.request(method, url, headers=headers, json=body, timeout=30)
    _assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_answer_without_the_key(guarded: RunningServer, path: str) -> None:
    assert _get(guarded, path).status_code == 200


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(
    guarded: RunningServer,
) -> None:
    client = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_the_openai_client_with_the_key_is_served(guarded: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, timeout=60)
    assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_refusals_are_counted_by_status(guarded: RunningServer) -> None:
    label = {"endpoint": "/v1/completions", "status": "401"}
    before = guarded.sample("graphguard_server_requests_total", **label)
    httpx.post(f"{guarded.base_url}/v1/completions", json={}, timeout=30)
    assert guarded.sample("graphguard_server_requests_total", **label) == before + 1


def test_the_key_stays_out_of_the_config_repr() -> None:
    assert API_KEY not in repr(ServerConfig(api_key=API_KEY))
