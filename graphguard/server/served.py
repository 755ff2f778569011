"""`ServedEngine`: what the endpoints need of the engine, whichever way it runs.

Two kinds provide it: `EngineProcessClient` (graphguard/server/engine_client.py), the default,
whose engine steps in a process of its own, and `AsyncEngine`
(graphguard/server/async_engine.py), whose engine steps on a thread of the server's process
(`--no-engine-process`: for debugging, and for tests that reach into the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from graphguard.engine.models.vision import VisionEncoder
from graphguard.server.async_engine import RequestStream
from graphguard.server.engine_messages import EngineInfo, EngineRequest


class ServedEngine(Protocol):
    """The asyncio-facing engine. Every method but `shutdown` runs on the event loop."""

    info: EngineInfo  # read once at start: tokenizer, limits, startup lines

    def start(self) -> None: ...

    async def generate(self, requests: Sequence[EngineRequest]) -> list[RequestStream]: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def vision(self) -> VisionEncoder | None: ...

    @property
    def graph_registry(self) -> CollectorRegistry | None: ...

    async def graphs_report(self) -> dict[str, Any]: ...

    def shutdown(self, timeout_s: float = 30.0) -> None: ...
