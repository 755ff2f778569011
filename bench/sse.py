"""What a client reads from a streamed /v1/completions: when the first and the last text
arrived and how many tokens the usage chunk counted (bench/serve_load.py reads streams
asynchronously, bench/serve_vs_offline.py synchronously; both feed their lines here)."""

from __future__ import annotations

import json
import time


class StreamReading:
    """Feed it a stream's lines as they arrive."""

    def __init__(self) -> None:
        self.first_text_s: float | None = None  # time.perf_counter() of the first text
        self.last_text_s: float | None = None
        self.num_tokens = 0  # completion tokens, from the usage chunk

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line.removeprefix("data: "))
        if chunk.get("usage"):
            self.num_tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["text"]:
            self.last_text_s = time.perf_counter()
            self.first_text_s = self.first_text_s or self.last_text_s
