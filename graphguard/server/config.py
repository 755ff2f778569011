"""Frozen server configuration; `graphguard serve` takes its flag defaults from these fields."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from graphguard.engine.config import EngineConfig
from graphguard.server.tool_parsers import TOOL_CALL_PARSERS

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "GRAPHGUARD_API_KEY"  # read by `graphguard serve` when --api-key is not given
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Whether listening on `host` serves this machine only (`127.0.0.1`, `::1`, `localhost`)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens, the name it answers to, who may call it, and the engine it
    serves.

    `served_model_name` None means: derive it from `engine.model` (see `model_name`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    # Clients must send `Authorization: Bearer <key>` (but to /health and /metrics), one of
    # these keys, comma separated (vLLM's --api-key takes several too).
    api_key: str | None = field(default=None, repr=False)
    # Whose cached prompt prefixes a request may reuse: "key", only those of requests under
    # the same API key (and cache_salt); "shared", those of every request of its cache_salt.
    # Reuse shows in the time to the first token, so sharing lets one key learn what another
    # sent (docs/serving.md, Security).
    prefix_cache_isolation: str = "key"
    # Host header names accepted besides the loopback ones (see `allowed_host_names`).
    allowed_hosts: tuple[str, ...] = ()
    max_request_bytes: int = 4 << 20  # a larger request body gets a 413 before it is parsed
    # Seconds a client may take to send a request's headers, then its body (a 408, or a close
    # when nothing came): a slow sender cannot hold a connection open for ever (slowloris).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0  # the whole body: 4 MiB in a minute is 70 KB/s
    # The interpreter's thread switch interval while serving (sys.setswitchinterval), in ms.
    # The engine thread's steps and the event loop share one interpreter lock; each time the
    # loop gives it up for a system call (a socket read or write), it waits up to this long
    # to get it back from a step. With Python's 5 ms, time to first token under load was up
    # to 40% longer (docs/serving.md).
    switch_interval_ms: float = 0.5
    # The engine steps in a process of its own (graphguard/server/engine_process.py), so that
    # HTTP, tokenizing and SSE framing never hold its interpreter lock; False steps it on a
    # thread of the server's process (for debugging, and for tests that reach into it).
    engine_process: bool = True
    # API server processes over the one engine process (vLLM's --api-server-count): each
    # feeds its share of the streams (graphguard/server/api_servers.py)
    api_server_count: int = 1
    # Seconds uvicorn waits for open responses after a shutdown signal before cancelling them.
    graceful_shutdown_s: float = 5.0
    # A request field this server does not know is a 400 naming it; permissive ignores it
    # (with a log line), as vLLM does, for clients that send fields of other servers.
    permissive: bool = False
    # vLLM's --generation-config: the sampling defaults of fields a request does not set
    # (graphguard/engine/generation_config.py): "auto", "vllm" or a folder.
    generation_config: str = "auto"
    # A chat template (a file's path, or the template itself) in place of the model's.
    chat_template: str | None = None
    # vLLM's --tool-call-parser: the format the model writes tool calls in
    # (graphguard/server/tool_parsers.py); auto reads it from the chat template
    tool_call_parser: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.api_key is not None and not all(key.strip() for key in self.api_key.split(",")):
            raise ValueError("api_key must not be empty (leave it unset to serve without one)")
        if self.api_server_count < 1 or (self.api_server_count > 1 and not self.engine_process):
            raise ValueError(
                "api_server_count must be >= 1, and above 1 only with the engine in a process "
                f"of its own, got {self.api_server_count}"
            )
        if self.prefix_cache_isolation not in ("key", "shared"):
            raise ValueError(
                f"prefix_cache_isolation must be key or shared, got {self.prefix_cache_isolation!r}"
            )
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; graphguard reads "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )
        for name in ("header_timeout_s", "body_timeout_s", "switch_interval_ms"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def allowed_host_names(self) -> frozenset[str] | None:
        """Host header names the server answers, or None for any.

        Listening on loopback, only loopback names (and `allowed_hosts`): a web page whose
        name an attacker re-points at 127.0.0.1 (DNS rebinding) sends its own name. Listening
        elsewhere, the names clients use are unknown unless `allowed_hosts` lists them.
        """
        if not self.allowed_hosts and not is_loopback(self.host):
            return None
        own = self.host.strip("[]").lower()
        return LOOPBACK_NAMES | {own} | {name.lower() for name in self.allowed_hosts}

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys `api_key` lists (none where it is unset)."""
        return tuple(key.strip() for key in (self.api_key or "").split(",") if key.strip())

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
