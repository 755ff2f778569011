"""`n` above 1: n choices per prompt, ordered by `index`, from one prefill of the prompt (the
other choices are forks that share its KV blocks); usage counts the prompt once and sums the
completions; seeded choices are distinct and reproducible; every block comes back."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai import OpenAI

from .helpers import MODEL, RunningServer, wait_for

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "Name a colour."}]
KV_USED = "graphguard_server_kv_blocks_used"
RUNNING = "graphguard_server_requests_running"


def _prefilled(server: RunningServer) -> int:
    return int(server.engine.stats()["num_prefilled_tokens"])


def test_n_choices_come_in_index_order_from_one_prefill(
    client: OpenAI, server: RunningServer
) -> None:
    num_prompt = len(server.tokenizer.encode(PROMPT))
    before = _prefilled(server)
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, n=4, max_tokens=6, temperature=1.0, seed=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert _prefilled(server) - before == num_prompt  # not 4 * num_prompt
    assert wait_for(lambda: server.sample(KV_USED) == 0, timeout_s=5)


def test_usage_counts_the_prompt_once_and_sums_the_completions(
    client: OpenAI, server: RunningServer
) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, max_tokens=5, extra_body={"ignore_eos": True}
    )
    alone = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert reply.usage is not None and alone.usage is not None
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * 5
    assert reply.usage.total_tokens == alone.usage.prompt_tokens + 15


def test_seeded_choices_are_distinct_and_the_same_on_every_call(client: OpenAI) -> None:
    def texts() -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL, messages=QUESTION, n=3, max_tokens=12, temperature=1.0, seed=11
        )
        return [c.message.content or "" for c in reply.choices]

    first = texts()
    assert len(set(first)) == 3
    assert texts() == first
    one = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, seed=11
    )
    assert one.choices[0].message.content == first[0]  # choice 0 keeps the request's seed


def test_greedy_choices_all_give_the_n1_answer(client: OpenAI) -> None:
    greedy: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 6}
    alone = client.completions.create(prompt=PROMPT, **greedy).choices[0].text
    reply = client.completions.create(prompt=PROMPT, n=3, **greedy)
    assert [c.text for c in reply.choices] == [alone] * 3


def test_several_prompts_get_n_choices_each_prompt_major(client: OpenAI) -> None:
    greedy: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 4}
    prompts = [PROMPT, "1, 2, 3, 4,"]
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]
    reply = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [alone[0], alone[0], alone[1], alone[1]]


def test_streamed_choices_each_open_and_finish_under_their_index(server: RunningServer) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "n": 2,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{server.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    *chunks, usage = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 2
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]].append(choice)
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] is not None for c in choices][-1]
        assert all(c["finish_reason"] is None for c in choices[:-1])


def test_a_disconnect_aborts_every_choice_and_frees_the_shared_blocks(
    server: RunningServer,
) -> None:
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a lighthouse.",
        "n": 3,
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        for _ in range(6):
            next(events)
        assert server.sample(RUNNING) == 3
    assert wait_for(lambda: server.sample(KV_USED) == 0, timeout_s=5)
    assert wait_for(lambda: server.sample(RUNNING) == 0, timeout_s=5)
    assert server.engine.stats()["kv_blocks_used"] == 0
