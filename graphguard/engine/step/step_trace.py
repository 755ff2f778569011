"""A timeline of the engine's steps, to see where a request's time went.

With GRAPHGUARD_STEP_TRACE set to a path, an engine appends one JSON line to it per request
added and per step: wall-clock time (`unix`, seconds, comparable across processes), the step's
length, what ran in it (requests waiting and running after it, outputs, the units of a capture
in flight that ran before it and their time) and the engine's count of decode steps launched
ahead. Off by default; a line costs a few microseconds.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

TRACE_ENV = "GRAPHGUARD_STEP_TRACE"


class StepTrace:
    """Appends the engine's step timeline to a file (see module docstring)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1 << 16)  # noqa: SIM115 - closed by close()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def added(self, request_id: str, num_prompt_tokens: int) -> None:
        self._write(event="add", request_id=request_id, prompt_tokens=num_prompt_tokens)

    def step(
        self,
        started: float,
        *,
        waiting: int,
        running: int,
        outputs: int,
        capture_units: int,
        capture_ms: float,
        steps_ahead: int,
    ) -> None:
        """A step that began at `started` (time.perf_counter) and ends now."""
        self._write(
            event="step",
            ms=round((time.perf_counter() - started) * 1e3, 3),
            waiting=waiting,
            running=running,
            outputs=outputs,
            capture_units=capture_units,
            capture_ms=round(capture_ms, 3),
            steps_ahead=steps_ahead,
        )

    def close(self) -> None:
        self._file.close()

    def _write(self, **fields: Any) -> None:
        if not self._file.closed:
            self._file.write(json.dumps({"unix": round(time.time(), 6), **fields}) + "\n")
