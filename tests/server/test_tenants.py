"""Tenants kept apart in the prefix cache: a server of several API keys reuses a cached prompt
prefix only under the key (and `cache_salt`) that wrote it, unless it shares on purpose; what
the cache reused is read from the engine itself, not timed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from graphguard.engine.engine import LLMEngine

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import MODEL, RunningServer

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
DOCUMENT = "The minutes of the board meeting. " * 40  # several KV blocks


@pytest.fixture(scope="module")
def isolated(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(engine_sharing_weights(engine), TEST_ENGINE, api_key=",".join(KEYS))


@pytest.fixture(scope="module")
def shared(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(
        engine_sharing_weights(engine), TEST_ENGINE, api_key=",".join(KEYS),
        prefix_cache_isolation="shared",
    )  # fmt: skip


def _reused_tokens(server: RunningServer, key: str, prompt: str, **fields: object) -> int:
    """Prompt tokens the engine took from its cache for this one request."""
    assert server.in_process is not None
    cache = server.in_process.scheduler.prefix_cache
    assert cache is not None
    before = cache.num_hit_tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields}
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return cache.num_hit_tokens - before


def test_every_listed_key_is_let_in_and_no_other(isolated: RunningServer) -> None:
    for key, status in [(KEYS[0], 200), (KEYS[1], 200), ("key-of-nobody", 401)]:
        response = httpx.post(
            f"{isolated.base_url}/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert response.status_code == status


def test_a_key_reuses_only_the_prefixes_its_own_requests_wrote(isolated: RunningServer) -> None:
    prompt = "Tenant A's secret. " + DOCUMENT
    assert _reused_tokens(isolated, KEYS[0], prompt) == 0
    assert _reused_tokens(isolated, KEYS[1], prompt) == 0  # another key: nothing to learn
    assert _reused_tokens(isolated, KEYS[0], prompt) > 0  # its own: reused
    # the same cache_salt under two keys is still two tenants
    salted = "Salted. " + DOCUMENT
    assert _reused_tokens(isolated, KEYS[0], salted, cache_salt="team") == 0
    assert _reused_tokens(isolated, KEYS[1], salted, cache_salt="team") == 0
    assert _reused_tokens(isolated, KEYS[1], salted, cache_salt="team") > 0


def test_a_shared_cache_reuses_across_keys_but_not_across_salts(shared: RunningServer) -> None:
    prompt = "A shared system prompt. " + DOCUMENT
    assert _reused_tokens(shared, KEYS[0], prompt) == 0
    assert _reused_tokens(shared, KEYS[1], prompt) > 0
    assert _reused_tokens(shared, KEYS[0], "Salt. " + DOCUMENT, cache_salt="a") == 0
    assert _reused_tokens(shared, KEYS[1], "Salt. " + DOCUMENT, cache_salt="b") == 0
