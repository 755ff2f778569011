"""`graphguard serve`: load the engine, log what it runs, and serve it with uvicorn.

Its flags are the settings of `ServerConfig`, `EngineConfig` and `GraphConfig`
(graphguard/server/flags.py), with their defaults, so there is one place to change a default.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from graphguard.server.api_servers import start_api_servers, stop_api_servers
from graphguard.server.config import ServerConfig
from graphguard.server.flags import add_flags, configs_from_args, format_bytes
from graphguard.server.http_process import (
    prepare_interpreter,
    serve,
)

if TYPE_CHECKING:
    from graphguard.engine.config import EngineConfig
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
    """Entry point of `graphguard serve`; returns the process exit code.

    What can be checked before the weights load is: the flags, the port (bound now and held),
    the model's path and the context it allows. Each failure is one line (with its traceback
    under --log-level debug) and exit status 2."""
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
    try:
        listener = bind_listener(config)
        check_model(config.engine)
        logger.info("loading %s", config.model_name)
        engine = start_engine(config)
    except (OSError, ValueError, RuntimeError) as exc:  # what the setup cannot honour
        logger.error("cannot start: %s", exc, exc_info=logger.isEnabledFor(logging.DEBUG))
        return 2
    # Imported here: `--help` and a refused start must not pay for FastAPI.
    from graphguard.server.app import build_app

    app = build_app(engine, config)
    for line in describe_engine(app.state.serving.engine.info, config):
        logger.info("%s", line)
    logger.info("OpenAI API at http://%s:%d/v1 (model id %r)", config.host, config.port,
                config.model_name)  # fmt: skip
    logger.info("%s", describe_access(config))
    prepare_interpreter(config)
    others = start_api_servers(config, listener, getattr(engine, "other_pipes", []))
    return serve(app, config, listener, before_shutdown=lambda: stop_api_servers(others))


def bind_listener(config: ServerConfig) -> socket.socket:
    """The server's listening socket, bound before anything slow starts (OSError naming the
    address when it is taken)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((config.host.strip("[]"), config.port))
    except OSError as exc:
        listener.close()
        raise OSError(f"cannot listen on {config.host}:{config.port}: {exc.strerror}") from exc
    listener.listen(2048)
    listener.set_inheritable(False)
    return listener


def check_model(config: EngineConfig) -> None:
    """The model's path exists and its context takes max_model_len, where its config can be
    read without loading it (ValueError, FileNotFoundError)."""
    from graphguard.engine.config import model_len
    from graphguard.engine.models.loader import read_model_config

    model_config = read_model_config(config.model)
    if model_config is not None:
        model_len(config, model_config.max_position_embeddings)


def start_engine(config: ServerConfig) -> LLMEngine | EngineProcessClient:
    """The engine `config` asks for: launched in a process of its own (the default), or built
    in this one (`engine_process` False)."""
    from graphguard.server.engine_client import EngineProcessClient
    from graphguard.server.engine_process import build_engine

    if config.engine_process:
        return EngineProcessClient.launch(
            config.engine, config.log_level, num_servers=config.api_server_count
        )
    return build_engine(config.engine)


if __name__ == "__main__":
    sys.exit(main())
