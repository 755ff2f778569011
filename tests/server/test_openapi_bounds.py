"""The OpenAPI document's bounds are validation's: for every bounded number of a request body
(a field, an array's items, an object's values), the server accepts the value at the bound
the document admits and refuses (400, naming the field) the first value past it. Bounds that
depend on the server (token ids below its vocabulary size, `n` up to --max-num-seqs) are this
server's."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from .conftest import TEST_ENGINE
from .helpers import MODEL, RunningServer

# A body each operation accepts, to which one bounded field is added. Completions echo the
# prompt, so that max_tokens 0 (its minimum) is a valid request.
BASE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "echo": True},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "logprobs": True,  # top_logprobs needs it
    },
    "/detokenize": {"tokens": [1]},
}
ALIASES = {"max_tokens": "max_completion_tokens", "max_completion_tokens": "max_tokens"}
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@pytest.fixture(scope="module")
def document(server: RunningServer) -> dict[str, Any]:
    return dict(httpx.get(f"{server.base_url}/openapi.json", timeout=10).json())


def _request_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    content = document["paths"][path]["post"]["requestBody"]["content"]
    ref = content["application/json"]["schema"]["$ref"]
    return dict(document["components"]["schemas"][ref.rsplit("/", 1)[1]])


def _bounded(schema: dict[str, Any]) -> Iterator[tuple[dict[str, Any], Any]]:
    """Each bounded number schema under a property's schema, with how a value of it is sent
    (a callable wrapping the value: as itself, in an array, as an object's value)."""
    if any(k in schema for k in BOUND_KEYWORDS) and schema.get("type") in ("integer", "number"):
        yield schema, lambda v: v
    for branch in schema.get("anyOf", []):
        yield from _bounded(branch)
    if isinstance(schema.get("items"), dict):
        yield from ((s, lambda v, w=wrap: [w(v)]) for s, wrap in _bounded(schema["items"]))
    if isinstance(schema.get("additionalProperties"), dict):
        extra = schema["additionalProperties"] | {"type": "number"}
        yield from ((s, lambda v, w=wrap: {"1": w(v)}) for s, wrap in _bounded(extra))


def _step(value: float, kind: str, direction: float) -> float:
    return value + direction if kind == "integer" else math.nextafter(value, direction * math.inf)


def _cases(schema: dict[str, Any]) -> Iterator[tuple[float, bool]]:
    """(value, whether the document admits it) at and just past each bound."""
    kind = schema["type"]
    for keyword, inward in [("minimum", 1), ("exclusiveMinimum", 1), ("maximum", -1)]:
        if keyword in schema:
            bound = schema[keyword]
            inside = bound if keyword != "exclusiveMinimum" else _step(bound, kind, inward)
            yield inside, True
            yield _step(inside, kind, -inward), False
    assert "exclusiveMaximum" not in schema  # none yet: add its two cases when one appears


def _all_cases(document: dict[str, Any]) -> Iterator[tuple[str, str, Any, bool]]:
    for path in BASE_BODIES:
        for name, prop in _request_schema(document, path)["properties"].items():
            for schema, wrap in _bounded(prop):
                for value, admitted in _cases(schema):
                    yield path, name, wrap(value), admitted


def test_the_document_states_this_servers_bounds(document: dict[str, Any]) -> None:
    completions = _request_schema(document, "/v1/completions")["properties"]
    vocab_size = 49152  # the embedded model's
    stop_ids = completions["stop_token_ids"]["anyOf"][0]["items"]
    assert stop_ids["maximum"] == vocab_size - 1 and "x-server-bound" not in stop_ids
    assert completions["n"]["maximum"] == TEST_ENGINE.max_num_seqs
    assert completions["top_p"]["anyOf"][0]["exclusiveMinimum"] > 0.0
    assert completions["seed"]["anyOf"][0]["maximum"] == (1 << 63) - 1  # exact, not a float


def test_every_bounded_number_is_accepted_at_its_bound_and_refused_past_it(
    server: RunningServer, document: dict[str, Any]
) -> None:
    cases = list(_all_cases(document))
    fields = {name for _, name, _, _ in cases}
    assert {"max_tokens", "top_p", "n", "seed", "logit_bias", "prompt", "tokens"} <= fields
    # Sent together, so that the engine batches the accepted ones.
    with ThreadPoolExecutor(max_workers=TEST_ENGINE.max_num_seqs) as pool:
        outcomes = list(pool.map(lambda case: _outcome(server, *case), cases))
    assert [outcome for outcome in outcomes if outcome is not None] == []


def _outcome(
    server: RunningServer, path: str, name: str, value: Any, admitted: bool
) -> tuple[Any, ...] | None:
    """None if the server answers (path, name: value) as the document says, else the case
    and the answer."""
    body = {k: v for k, v in BASE_BODIES[path].items() if k != ALIASES.get(name)}
    response = httpx.post(f"{server.base_url}{path}", json=body | {name: value}, timeout=120)
    param = response.json().get("error", {}).get("param") or ""
    if admitted and response.status_code == 200:
        return None
    if not admitted and response.status_code == 400 and param.startswith(name):
        return None
    return path, name, value, response.status_code, response.text[:200]
