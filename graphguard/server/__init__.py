"""OpenAI-compatible HTTP server for the graphguard engine.

`build_app(engine, config)` returns a FastAPI app that serves one `LLMEngine`;
`graphguard serve` (see `graphguard.server.cli`) loads the engine and runs it under uvicorn.
The FastAPI stack is imported only when this package is used, so the library itself does not
need it.
"""

from __future__ import annotations

from graphguard.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str) -> object:
    # NOTE: lazy so that `import graphguard.server.config` works without fastapi installed.
    if name == "build_app":
        from graphguard.server.app import build_app

        return build_app
    raise AttributeError(name)
