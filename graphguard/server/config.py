"""Frozen server configuration; `graphguard serve` takes its flag defaults from these fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from graphguard.engine.config import EngineConfig

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens, the name it answers to, and the engine it serves.

    `served_model_name` None means: derive it from `engine.model` (see `model_name`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    # Seconds uvicorn waits for open responses after a shutdown signal before cancelling them.
    graceful_shutdown_s: float = 5.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def model_name(self) -> str:
        """The `model` id clients must send: the served name, else the model file's stem."""
        if self.served_model_name:
            return self.served_model_name
        source = self.engine.model
        if source is None or source == "embedded":
            return EMBEDDED_MODEL_NAME
        stem = os.path.basename(os.path.normpath(source))
        return stem.removesuffix(".gguf") or source
