"""bench/serve_load.py's load client against the real server: the token counts and times it
reports are those of the streams it read."""

from __future__ import annotations

import argparse
import asyncio

from bench import serve_load

from .helpers import MODEL, RunningServer


def test_the_load_client_counts_every_streamed_token_and_times_its_arrival(
    server: RunningServer,
) -> None:
    args = argparse.Namespace(num_requests=4, concurrency=2, max_tokens=5, prompt_spread=3)
    results = asyncio.run(serve_load.run_load(server.base_url, MODEL, args))

    assert len(results) == 4
    for result in results:
        assert result.num_output_tokens == 5  # the usage chunk's count: ignore_eos holds it
        assert 0 < result.ttft_s <= result.latency_s
        assert result.tpot_s is not None and result.tpot_s >= 0  # tokens may share an event
    # at most two at a time: the third request was sent after one of the first two ended
    first_ends = sorted(r.sent_s + r.latency_s for r in results)[:2]
    third_sent = sorted(r.sent_s for r in results)[2]
    assert third_sent >= first_ends[0]
