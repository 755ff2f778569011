"""One real server for the whole suite: the embedded model behind uvicorn on 127.0.0.1, its
engine in a process of its own (the default). Fixtures that need a second server share the
session engine's weights and step it on a thread of this process (`engine_process` off).

The model loads once per session (about 2 s from the user cache, ~35 s the first time), and
once more in the engine process. The KV pool is deliberately smaller than the context (63
usable blocks x 16 = 1008 tokens against max_model_len 1024) so that the engine's own
admission check can be exercised.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import uvicorn  # noqa: E402
from openai import OpenAI  # noqa: E402

from graphguard.engine.config import EngineConfig  # noqa: E402
from graphguard.engine.engine import LLMEngine  # noqa: E402
from graphguard.engine.models.loader import LoadedModel  # noqa: E402
from graphguard.server.app import build_app  # noqa: E402
from graphguard.server.cli import start_engine  # noqa: E402
from graphguard.server.config import ServerConfig  # noqa: E402
from graphguard.server.http_process import uvicorn_config  # noqa: E402

from .helpers import RunningServer, free_port  # noqa: E402

TEST_ENGINE = EngineConfig(max_model_len=1024, max_num_seqs=16, num_kv_blocks=64)
# The shared server's engine process loads its own weights: the 4-bit CPU kernels, as
# `graphguard serve` runs the embedded model here (about 7x float32's decode speed)
SERVER_ENGINE = dataclasses.replace(TEST_ENGINE, kernels="q4")


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    return LLMEngine(TEST_ENGINE)


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    yield from serve(None, SERVER_ENGINE)


def engine_sharing_weights(engine: LLMEngine, config: EngineConfig = TEST_ENGINE) -> LLMEngine:
    """A second engine (its own KV pool and thread) over the session engine's loaded model."""
    loaded = LoadedModel(engine.loaded.name, engine.model, engine.model_config, engine.tokenizer)
    return LLMEngine(config, loaded)


def serve(
    engine: LLMEngine | None, engine_config: EngineConfig, **server_fields: Any
) -> Iterator[RunningServer]:
    """Run `engine` behind uvicorn on a free loopback port until the generator is closed;
    None: an engine process of `engine_config`, as `graphguard serve` runs by default.
    `server_fields` are ServerConfig fields (api_key, max_request_bytes, ...)."""
    server_fields.setdefault("log_level", "warning")
    server_fields.setdefault("engine_process", engine is None)
    config = ServerConfig(port=free_port(), engine=engine_config, **server_fields)
    # The settings `graphguard serve` runs with (its HTTP protocol and deadlines included).
    app = build_app(engine or start_engine(config), config)
    uv = uvicorn.Server(
        uvicorn_config(app, config, app.state.serving.metrics.record_header_timeout)
    )
    thread = threading.Thread(target=uv.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield RunningServer(f"http://{config.host}:{config.port}", app.state.serving.engine, engine)
    uv.should_exit = True
    thread.join(30)


@pytest.fixture()
def client(server: RunningServer) -> OpenAI:
    return server.openai(timeout=60)
