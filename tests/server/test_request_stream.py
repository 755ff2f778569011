"""A stream whose reader falls behind hands it the outputs waiting as one (one SSE event for
several tokens), and an engine error waiting behind outputs comes after them."""

from __future__ import annotations

import asyncio

import pytest

from graphguard.engine.outputs import RequestOutput
from graphguard.server.async_engine import RequestStream


def _output(token_id: int, text: str, so_far: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=[token_id],
        delta_text=text,
        text=so_far + text,
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=token_id,
    )


def test_outputs_waiting_for_a_slow_reader_arrive_as_one() -> None:
    async def run() -> list[RequestOutput]:
        stream = RequestStream("r", 3)
        stream.put(_output(1, "a", ""))
        stream.put(_output(2, "b", "a"))
        stream.put(_output(3, "c", "ab", finished=True))
        return [output async for output in stream]

    (merged,) = asyncio.run(run())
    assert merged.new_token_ids == [1, 2, 3] and merged.delta_text == "abc"
    assert merged.text == "abc" and merged.finished and merged.num_output_tokens == 3


def test_a_reader_that_keeps_up_gets_each_output() -> None:
    async def run() -> list[RequestOutput]:
        stream = RequestStream("r", 3)
        received = []
        stream.put(_output(1, "a", ""))
        received.append(await stream.__anext__())
        stream.put(_output(2, "b", "a", finished=True))
        received.append(await stream.__anext__())
        return received

    assert [o.new_token_ids for o in asyncio.run(run())] == [[1], [2]]


def test_an_error_behind_outputs_is_raised_after_them() -> None:
    async def run() -> tuple[RequestOutput, BaseException | None]:
        stream = RequestStream("r", 3)
        stream.put(_output(1, "a", ""))
        stream.put(_output(2, "b", "a"))
        stream.put(RuntimeError("the engine failed"))
        first = await stream.__anext__()
        with pytest.raises(RuntimeError, match="engine failed"):
            await stream.__anext__()
        return first, None

    first, _ = asyncio.run(run())
    assert first.new_token_ids == [1, 2]
