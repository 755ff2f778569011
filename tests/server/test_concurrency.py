"""Many clients at once: every stream completes, well formed, while sharing decode steps."""

from __future__ import annotations

import asyncio
import json

import httpx
from openai import AsyncOpenAI

from .helpers import MODEL, RunningServer

NUM_CLIENTS = 16


async def _raw_stream(client: httpx.AsyncClient, index: int) -> list[str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count to {index + 3}."}],
        "max_tokens": 6,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line]


def test_sixteen_concurrent_raw_streams_each_end_in_done(server: RunningServer) -> None:
    async def run_all() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*(_raw_stream(client, i) for i in range(NUM_CLIENTS)))

    for lines in asyncio.run(run_all()):
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert len({c["id"] for c in chunks}) == 1  # one request per stream, not interleaved
        finish_reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finish_reasons[-1] in ("stop", "length")
        assert all(reason is None for reason in finish_reasons[:-1])


def test_sixteen_concurrent_openai_streams_all_finish(server: RunningServer) -> None:
    async def one(client: AsyncOpenAI, index: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"{index}, {index + 1},", max_tokens=5, temperature=0, stream=True
        )
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def run_all() -> list[tuple[str, str | None]]:
        client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    before = server.engine.stats()
    results = asyncio.run(run_all())
    after = server.engine.stats()
    assert [reason for _, reason in results] == ["length"] * NUM_CLIENTS
    assert all(text for text, _ in results)
    # served one at a time, every step would make at most one token; fewer steps than tokens
    # means requests shared decode steps
    steps = after["num_steps"] - before["num_steps"]
    tokens = after["num_generated_tokens"] - before["num_generated_tokens"]
    assert tokens == 5 * NUM_CLIENTS and steps < tokens, (steps, tokens)
