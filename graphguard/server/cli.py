"""`graphguard serve`: load the engine, log what it runs, and serve it with uvicorn.

Flag defaults come from the fields of `ServerConfig` and `EngineConfig`, so there is one place
to change a default.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

import uvicorn

from graphguard.engine.config import EngineConfig
from graphguard.server.config import LOG_LEVELS, ServerConfig

logger = logging.getLogger("graphguard.server")

_SERVER = ServerConfig()
_ENGINE = _SERVER.engine
_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """`"1073741824"`, `"512MiB"`, `"1G"` or `"1gb"` -> bytes (binary units)."""
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _SIZE_SUFFIXES.get(cleaned[-1:], 1)
    number = cleaned[:-1] if scale != 1 else cleaned
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"byte size must be >= 0: {text!r}")
    return value


def parse_buckets(text: str) -> tuple[int, ...]:
    """`"1,2,4,8"` -> (1, 2, 4, 8): strictly increasing positive batch sizes."""
    try:
        buckets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not buckets or buckets[0] < 1 or list(buckets) != sorted(set(buckets)):
        raise argparse.ArgumentTypeError(f"need increasing positive integers: {text!r}")
    return buckets


def format_bytes(num_bytes: int) -> str:
    """1073741824 -> "1GiB"; sizes that are not whole binary units stay in bytes."""
    for suffix, scale in reversed(_SIZE_SUFFIXES.items()):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{suffix.upper()}iB"
    return str(num_bytes)


def build_parser() -> argparse.ArgumentParser:
    """The `graphguard serve` argument parser; defaults are read from the config dataclasses."""
    parser = argparse.ArgumentParser(
        prog="graphguard serve",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, "
        "/v1/completions, /v1/models, plus /health, /metrics (Prometheus) and /v1/graphs.",
    )
    _add_model_flags(parser.add_argument_group("model"))
    _add_engine_flags(parser.add_argument_group("engine"))
    _add_server_flags(parser.add_argument_group("server"))
    return parser


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model",
        default=_ENGINE.model,
        metavar="PATH",
        help="Hugging Face model folder or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--device",
        default=_ENGINE.device,
        help=f"auto, cpu, cuda or cuda:N; auto picks CUDA when present (default: {_ENGINE.device})",
    )
    group.add_argument(
        "--dtype",
        default=_ENGINE.dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        help=f"auto is bfloat16 on CUDA and float32 on CPU (default: {_ENGINE.dtype})",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=_ENGINE.max_model_len,
        metavar="N",
        help=f"longest prompt plus completion in tokens (default: {_ENGINE.max_model_len})",
    )


def _add_engine_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens one step may run, decodes and prefills together; a longer prompt is "
        "prefilled in chunks over several steps, so this bounds the time of a step "
        f"(default: the larger of {_ENGINE.max_num_batched_tokens} and --max-num-seqs)",
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=_ENGINE.block_size,
        metavar="N",
        help=f"tokens per KV cache block (default: {_ENGINE.block_size})",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=_ENGINE.seed,
        help=f"seed of requests that bring none (default: {_ENGINE.seed})",
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=_ENGINE.max_num_seqs,
        metavar="N",
        help=f"most requests decoded together (default: {_ENGINE.max_num_seqs})",
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_ENGINE.num_kv_blocks,
        metavar="N",
        help="KV cache blocks of --block-size tokens; 0 sizes the pool for "
        "max-num-seqs full-length requests, capped at half the free GPU memory or 1 GiB on "
        "CPU (default: 0)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        default=_ENGINE.enforce_eager,
        help="run decode and prefill eagerly, never through CUDA graphs",
    )
    group.add_argument(
        "--max-graph-bytes",
        type=parse_bytes,
        default=_ENGINE.max_graph_bytes,
        metavar="SIZE",
        help="byte budget of the decode graphs, and separately of the segmented prefill "
        f"graphs, e.g. 512MiB or 2GiB (default: {format_bytes(_ENGINE.max_graph_bytes)} each)",
    )
    group.add_argument(
        "--graph-manifest",
        default=_ENGINE.graph_manifest,
        metavar="PATH",
        help="prewarm the decode graphs listed in this manifest (written by export()) at start; "
        "a manifest from another torch, device or model is refused and graphs start lazily",
    )
    group.add_argument(
        "--warmup-graphs",
        action="store_true",
        default=_ENGINE.warmup_graphs,
        help="capture every decode graph the server can use (batch buckets up to "
        "--max-num-seqs, block-table widths up to --max-model-len) before serving, largest "
        "first within --max-graph-bytes; without it graphs are captured as traffic earns them",
    )
    group.add_argument(
        "--no-prefill-graphs",
        dest="prefill_graphs",
        action="store_false",
        default=_ENGINE.prefill_graphs,
        help="prefill eagerly while decode uses graphs: no segmented prefill captures inside "
        "engine steps (each one delays the requests of that step)",
    )
    buckets = ",".join(str(b) for b in _ENGINE.batch_buckets)
    group.add_argument(
        "--batch-buckets",
        type=parse_buckets,
        default=_ENGINE.batch_buckets,
        metavar="LIST",
        help="decode batch sizes that get a graph, comma separated; other sizes pad up, and "
        "batches above the largest run eagerly (unbucketed_shape), so keep the largest >= "
        f"--max-num-seqs (default: {buckets})",
    )


def _add_server_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--host", default=_SERVER.host, help=f"address to listen on (default: {_SERVER.host})"
    )
    group.add_argument(
        "--port",
        type=int,
        default=_SERVER.port,
        help=f"port to listen on (default: {_SERVER.port})",
    )
    group.add_argument(
        "--served-model-name",
        default=_SERVER.served_model_name,
        metavar="NAME",
        help="model id clients send (default: the model's name)",
    )
    group.add_argument(
        "--log-level",
        default=_SERVER.log_level,
        choices=LOG_LEVELS,
        help=f"(default: {_SERVER.log_level})",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The frozen ServerConfig (with its EngineConfig) that `args` describe."""
    engine = replace(
        EngineConfig(),
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        max_graph_bytes=args.max_graph_bytes,
        batch_buckets=tuple(args.batch_buckets),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens
        or max(_ENGINE.max_num_batched_tokens, args.max_num_seqs),
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        seed=args.seed,
        graph_manifest=args.graph_manifest,
        warmup_graphs=args.warmup_graphs,
        prefill_graphs=args.prefill_graphs,
    )
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        engine=engine,
    )


def describe_engine(engine: Any, config: ServerConfig) -> list[str]:
    """Startup lines: model, device, dtype, KV blocks, and whether decode graphs are on."""
    from graphguard.server.app import graphs_off_reason

    stats = engine.stats()
    source = config.engine.model or "embedded"
    device, max_model_len = engine.device, engine.max_model_len
    dtype = str(engine.dtype).removeprefix("torch.")
    kv = (
        f"{stats.get('kv_blocks_total', '?')} blocks x {config.engine.block_size} tokens "
        f"({stats.get('kv_bytes', 0) / (1 << 20):.0f} MiB)"
    )
    graphs = engine.graphs
    if graphs is None:
        graph_line = f"decode graphs: off ({graphs_off_reason(engine)})"
    else:
        graph_line = f"decode graphs: on ({graphs.enabled_reason})"
    return [
        f"model: {config.model_name} ({source})",
        f"device: {device}, dtype: {dtype}, max model len: {max_model_len}",
        f"KV cache: {kv}, max num seqs: {config.engine.max_num_seqs}",
        graph_line,
    ]


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
    from graphguard.engine.engine import LLMEngine
    from graphguard.server.app import build_app

    logger.info("loading %s", config.model_name)
    try:
        engine = LLMEngine(config.engine)
    except ValueError as exc:  # a setting the model or the memory cannot honour
        logger.error("cannot start: %s", exc)
        return 2
    for line in describe_engine(engine, config):
        logger.info("%s", line)
    app = build_app(engine, config)
    logger.info("OpenAI API at http://%s:%d/v1 (model id %r)", config.host, config.port,
                config.model_name)  # fmt: skip
    return serve(app, config)


def serve(app: Any, config: ServerConfig) -> int:
    """Run `app` under uvicorn until SIGINT or SIGTERM; 0 after a clean shutdown."""
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.graceful_shutdown_s),
    )
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
