"""Replicas: independent servers on one machine, as a load balancer would see them
(docs/parallel.md). The server keeps no state between requests, so either one answers alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from graphguard.engine.engine import LLMEngine

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import MODEL, RunningServer


@pytest.fixture(scope="module")
def second_replica(engine: LLMEngine) -> Iterator[RunningServer]:
    replica = engine_sharing_weights(engine)  # its own KV pool, step thread, port
    yield from serve(replica, TEST_ENGINE)
    replica.shutdown()


def test_two_replicas_on_two_ports_answer_a_greedy_request_alike(server, second_replica):
    assert server.base_url != second_replica.base_url
    answers = []
    for replica in (server, second_replica):
        reply = replica.openai(timeout=60).completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
        )
        answers.append(reply.choices[0].text)
    assert answers[0] == answers[1] and answers[0].startswith(" Paris")
