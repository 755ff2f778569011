"""Several API server processes over one engine process (`--api-server-count N`).

The HTTP work of a stream (parsing, tokenizing, SSE framing, one event per token) runs in an
API server process's interpreter, and one interpreter bounds how many streams it can feed (at
64 streams on an H100 the single server process was busy all the time while the engine had
room). With N of them, the first (the process `graphguard serve` started) launches the engine
process with a pipe for each and starts the other N - 1; all accept connections from one
listening socket, bound once before anything loads, and the kernel spreads the connections
among them. Each request's outputs go back to the process that admitted it
(graphguard/server/engine_process.py). The first process owns the engine's life: it stops the
others before it stops the engine, and if the engine process dies, every process answers 503s
and exits with status 3.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import sys
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from graphguard.server.config import ServerConfig

logger = logging.getLogger("graphguard.server")
STOP_TIMEOUT_S = 10.0


def start_api_servers(
    config: ServerConfig, listener: socket.socket, pipes: list[Connection]
) -> list[BaseProcess]:
    """The other API server processes, one per pipe, each serving `listener`."""
    context = mp.get_context("spawn")
    processes: list[BaseProcess] = []
    for index, pipe in enumerate(pipes, start=1):
        process = context.Process(
            target=api_server_main, args=(config, listener, pipe), name=f"graphguard-api-{index}"
        )
        process.start()
        pipe.close()  # the child has its own copy
        processes.append(process)
    if processes:
        logger.info("%d API server processes share the port", len(processes) + 1)
    return processes


def stop_api_servers(processes: list[BaseProcess]) -> None:
    """Ask the other API server processes to stop (SIGTERM: they end their streams), and wait."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            logger.error("API server process %s did not stop; killing it", process.pid)
            process.kill()
            process.join(5)


def api_server_main(config: ServerConfig, listener: socket.socket, pipe: Connection) -> None:
    """An API server process other than the first: serve `listener` with the engine process
    behind `pipe` until a signal, or until the engine process ends."""
    from graphguard.server.app import build_app
    from graphguard.server.engine_client import EngineProcessClient
    from graphguard.server.http_process import prepare_interpreter, serve

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = EngineProcessClient.attach(pipe)
    app = build_app(engine, config)
    prepare_interpreter(config)
    sys.exit(serve(app, config, listener))
