"""A request's own work stays on the event loop unless it is long: no hop to a worker thread for
the dependency that hands a handler its context, nor for tokenizing or templating short text
(each hop waits for the engine thread's step to hand the interpreter lock over, twice); a long
prompt is still tokenized on a worker, so that it does not hold the loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import fastapi.dependencies.utils as fastapi_dependencies
import pytest
from openai import OpenAI

import graphguard.server.context as context
from graphguard.server.context import INLINE_TEXT_CHARS


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions sent to a worker thread while the test runs."""
    sent: list[str] = []
    to_thread, in_threadpool = asyncio.to_thread, fastapi_dependencies.run_in_threadpool

    async def recording_to_thread(fn: Callable[..., Any], *args: Any) -> Any:
        sent.append(getattr(fn, "__name__", repr(fn)))
        return await to_thread(fn, *args)

    async def recording_threadpool(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sent.append(getattr(fn, "__name__", repr(fn)))
        return await in_threadpool(fn, *args, **kwargs)

    monkeypatch.setattr(context.asyncio, "to_thread", recording_to_thread)
    monkeypatch.setattr(fastapi_dependencies, "run_in_threadpool", recording_threadpool)
    return sent


def test_a_short_request_runs_nothing_on_a_worker_thread(client: OpenAI, hops: list[str]):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=1)
    messages = [{"role": "user", "content": "Hello"}]
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert hops == []


def test_a_long_prompt_is_tokenized_on_a_worker_thread(client: OpenAI, hops: list[str]):
    prompt = "word " * (INLINE_TEXT_CHARS // 5 + 1)
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1)
    assert hops == ["_token_ids"]
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert hops == ["_token_ids", "_render_ids"]
