"""The engine thread hands a step's outputs to the event loop with one wake-up for all of its
requests (graphguard/server/async_engine.py `deliver`), and every stream still gets each of
its outputs, in order."""

from __future__ import annotations

import asyncio

from graphguard.engine.engine import LLMEngine
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.server.async_engine import AsyncEngine, EngineRequest

from .conftest import engine_sharing_weights


def test_a_steps_outputs_wake_the_event_loop_once(engine: LLMEngine) -> None:
    async def run() -> tuple[list[int], dict[str, list[int]]]:
        loop = asyncio.get_running_loop()
        wakeups: list[int] = []
        wake = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakeups.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return wake(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        served = AsyncEngine(engine_sharing_weights(engine))
        served.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            requests = [EngineRequest(f"r{i}", [5 + i, 6, 7, 8], params) for i in range(4)]
            streams = await served.generate(requests)
            tokens: dict[str, list[int]] = {}
            for stream in streams:
                async for out in stream:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            return wakeups, tokens
        finally:
            await asyncio.to_thread(served.shutdown)

    wakeups, tokens = asyncio.run(run())
    assert {rid: len(ids) for rid, ids in tokens.items()} == {f"r{i}": 5 for i in range(4)}
    # the four requests ran together: their outputs came four to a wake-up, never one each
    step_wakeups = [n for n in wakeups if n > 1]
    assert step_wakeups and all(n == 4 for n in step_wakeups), wakeups
    assert len(step_wakeups) == 5  # the prefill step, then four decode steps
