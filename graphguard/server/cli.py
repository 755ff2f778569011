"""`graphguard serve`: load the engine, log what it runs, and serve it with uvicorn.

Its flags are the settings of `ServerConfig`, `EngineConfig` and `GraphConfig`
(graphguard/server/flags.py), with their defaults, so there is one place to change a default.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from graphguard.server.config import ServerConfig
from graphguard.server.flags import add_flags, configs_from_args, format_bytes

if TYPE_CHECKING:
    from graphguard.engine.engine import LLMEngine
    from graphguard.server.engine_client import EngineProcessClient
    from graphguard.server.engine_messages import EngineInfo

logger = logging.getLogger("graphguard.server")


def build_parser() -> argparse.ArgumentParser:
    """The `graphguard serve` argument parser: a flag per config setting (server/flags.py)."""
    parser = argparse.ArgumentParser(
        prog="graphguard serve",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
        "/v1/completions, /v1/models, plus /health, /metrics (Prometheus) and /v1/graphs.",
    )
    add_flags(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The frozen ServerConfig (with its EngineConfig) that `args` describe."""
    return configs_from_args(args)


def describe_engine(info: EngineInfo, config: ServerConfig) -> list[str]:
    """Startup lines: model, where the engine runs, device, dtype, KV blocks, kernels, and
    whether decode graphs are on."""
    source = config.engine.model or "embedded"
    where = f"process {info.pid}" if config.engine_process else "a thread of the server"
    return [f"model: {config.model_name} ({source}); engine in {where}", *info.description]


def describe_access(config: ServerConfig) -> str:
    """The startup line that says who may call the server."""
    key = "API key required" if config.api_key is not None else "no API key"
    allowed = config.allowed_host_names
    hosts = "any Host" if allowed is None else "Host in " + ", ".join(sorted(allowed))
    bodies = f"bodies up to {format_bytes(config.max_request_bytes)}"
    deadlines = f"headers in {config.header_timeout_s:g} s, bodies in {config.body_timeout_s:g} s"
    return f"access: {key}, {hosts}, {bodies}; {deadlines}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `graphguard serve`; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line and the reason
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before CUDA starts: pinned cuBLAS workspaces keep kernel choice the same on every stream,
    # which bitwise parity between a graph and eager relies on (docs/runtime.md).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Imported here: `--help` must not pay for torch, transformers and FastAPI.
    from graphguard.server.app import build_app

    logger.info("loading %s", config.model_name)
    try:
        engine = start_engine(config)
    except ValueError as exc:  # a setting the model or the memory cannot honour
        logger.error("cannot start: %s", exc)
        return 2
    app = build_app(engine, config)
    for line in describe_engine(app.state.serving.engine.info, config):
        logger.info("%s", line)
    logger.info("OpenAI API at http://%s:%d/v1 (model id %r)", config.host, config.port,
                config.model_name)  # fmt: skip
    logger.info("%s", describe_access(config))
    prepare_interpreter(config)
    return serve(app, config)


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


def start_engine(config: ServerConfig) -> LLMEngine | EngineProcessClient:
    """The engine `config` asks for: launched in a process of its own (the default), or built
    in this one (`engine_process` False)."""
    from graphguard.server.engine_client import EngineProcessClient
    from graphguard.server.engine_process import build_engine

    if config.engine_process:
        return EngineProcessClient.launch(config.engine, config.log_level)
    return build_engine(config.engine)


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


def serve(app: Any, config: ServerConfig) -> int:
    """Run `app` under uvicorn until SIGINT or SIGTERM; 0 after a clean shutdown."""
    uv_config = uvicorn_config(app, config, app.state.serving.metrics.record_header_timeout)
    server = AbortingServer(uv_config, on_shutdown=app.state.serving.engine.abort_all)
    # NOTE: uvicorn re-raises the signal it caught once it has shut down, under the handlers
    # that were installed before it started. Installing no-op handlers here makes a clean
    # SIGTERM/SIGINT shutdown exit with status 0 instead of dying of the re-raised signal.
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def _ignore_signal(sig: int, frame: FrameType | None) -> None:
    del sig, frame


class AbortingServer(uvicorn.Server):
    """A uvicorn.Server that aborts in-flight generations before it closes connections, so
    open streams end at once (finish_reason "abort") instead of running to their end."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


if __name__ == "__main__":
    sys.exit(main())
