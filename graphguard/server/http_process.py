"""One API server process: uvicorn serving the app, until a signal or the engine's end.

Shared by `graphguard serve` (graphguard/server/cli.py) and the other API server processes of
`--api-server-count` (graphguard/server/api_servers.py).
"""

from __future__ import annotations

import functools
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from graphguard.server.config import ServerConfig

logger = logging.getLogger("graphguard.server")
ENGINE_LOST_STATUS = 3  # the exit status of a server whose engine process died


def prepare_interpreter(config: ServerConfig) -> None:
    """Set the interpreter up for serving, once everything is loaded.

    What the process made at start (torch, the model, the server's modules) is moved out of
    the collector's reach: full collections over it paused steps for 100-140 ms on a GPU
    host, several times in a load. What serving makes is collected as before.

    The thread switch interval is `config.switch_interval_ms`: the event loop gives the
    interpreter lock up at every socket read or write and then waits for the engine thread's
    step to hand it back, up to one interval each time (docs/serving.md, "How it runs").
    """
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(config.switch_interval_ms / 1e3)


def uvicorn_config(
    app: Any, config: ServerConfig, on_header_timeout: Callable[[bool], None] | None = None
) -> uvicorn.Config:
    """uvicorn's settings for serving `app` under `config`: its HTTP protocol is h11 with a
    deadline for request headers (graphguard/server/timeouts.py), whose timeouts go to
    `on_header_timeout` (the server's metrics) when given."""
    from graphguard.server.timeouts import HeaderTimeoutProtocol

    extra = {"on_timeout": on_header_timeout} if on_header_timeout is not None else {}
    protocol = functools.partial(
        HeaderTimeoutProtocol, header_timeout_s=config.header_timeout_s, **extra
    )
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.graceful_shutdown_s),
        http=protocol,  # type: ignore[arg-type]  # uvicorn calls it as it calls a class
    )


def serve(
    app: Any,
    config: ServerConfig,
    listener: socket.socket | None = None,
    before_shutdown: Callable[[], None] | None = None,
) -> int:
    """Run `app` under uvicorn until SIGINT or SIGTERM (on `listener`, bound already, else
    on the config's address); 0 after a clean shutdown, ENGINE_LOST_STATUS when the engine
    process died. `before_shutdown` runs first when it ends (the first API server process
    stops the others there, before the engine they feed from)."""
    uv_config = uvicorn_config(app, config, app.state.serving.metrics.record_header_timeout)
    engine = app.state.serving.engine

    def stop() -> None:
        if before_shutdown is not None:
            before_shutdown()
        engine.abort_all()

    server = AbortingServer(uv_config, on_shutdown=stop)
    if hasattr(engine, "on_lost"):  # an engine process: if it dies, so does the server
        engine.on_lost = server.exit_for_lost_engine
    # NOTE: uvicorn re-raises the signal it caught once it has shut down, under the handlers
    # that were installed before it started. Installing no-op handlers here makes a clean
    # SIGTERM/SIGINT shutdown exit with status 0 instead of dying of the re-raised signal.
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[listener] if listener is not None else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.lost_engine:
        return ENGINE_LOST_STATUS
    return 0 if server.started else 1


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    del sig, frame


class AbortingServer(uvicorn.Server):
    """A uvicorn.Server that aborts in-flight generations before it closes connections, so
    open streams end at once (finish_reason "abort") instead of running to their end."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self.lost_engine = False

    def exit_for_lost_engine(self) -> None:
        """The engine process died: answer what is open with 503s and exit, non-zero, so that
        a supervisor (systemd, Kubernetes) starts a fresh server, as vLLM's does."""
        logger.error("the engine process died; exiting with status %d", ENGINE_LOST_STATUS)
        self.lost_engine = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)
