"""The flags of `graphguard serve`, one per setting of the config dataclasses.

Every field of `EngineConfig`, of its `GraphConfig` (by the flat names of `GRAPH_SETTINGS`) and
of `ServerConfig` is either a flag here or listed in `NOT_FLAGS` with the reason; the parser
and `configs_from_args` are built from that, and a test checks it covers every field. Defaults
are read from the dataclasses, so there is one place to change one.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from graphguard.engine.config import (
    GRAPH_SETTINGS,
    KERNEL_CHOICES,
    OVERLAP_CHOICES,
    EngineConfig,
    GraphConfig,
    engine_config,
)
from graphguard.server.config import API_KEY_ENV, LOG_LEVELS, ServerConfig
from graphguard.server.vllm_flags import (
    add_prefix_caching_aliases,
    add_vllm_flags,
    alias_options,
    checked_vllm_flags,
    dtype_name,
)

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


def parse_hosts(text: str) -> tuple[str, ...]:
    """`"api.example.com,gpu-box"` -> ("api.example.com", "gpu-box"): Host header names."""
    hosts = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    if not hosts or any(" " in host or "/" in host for host in hosts):
        raise argparse.ArgumentTypeError(f"not a comma list of host names: {text!r}")
    return hosts


def format_bytes(num_bytes: int) -> str:
    """1073741824 -> "1GiB"; sizes that are not whole binary units stay in bytes."""
    for suffix, scale in reversed(_SIZE_SUFFIXES.items()):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{suffix.upper()}iB"
    return str(num_bytes)


@dataclass(frozen=True)
class Flag:
    """One command-line flag; `help` may name `{default}` (the field's, shown by `show`)."""

    group: str  # "model" | "engine" | "server"
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a flag without a value that turns the setting on (or off: no_)
    no_: bool = False  # spelled --no-<name>, turning a default-on setting off
    show: Callable[[Any], str] = str


# setting name -> its flag; the name's underscores become dashes (--max-model-len)
FLAGS: dict[str, Flag] = {
    "model": Flag(
        "model",
        "Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
        metavar="PATH",
    ),
    "device": Flag(
        "model", "auto, cpu, cuda or cuda:N; auto picks CUDA when present (default: {default})"
    ),
    "dtype": Flag(
        "model",
        "auto is bfloat16 on CUDA and float32 on CPU; bfloat16 on a CPU with native "
        "bfloat16 decodes about 1.7x faster (default: {default})",
        choices=("auto", "float32", "bfloat16", "float16"),
        type=dtype_name,  # vLLM's half, bf16 and float too
    ),
    "max_model_len": Flag(
        "model",
        "longest prompt plus completion in tokens (default: {default})",
        type=int,
        metavar="N",
    ),
    "max_num_batched_tokens": Flag(
        "engine",
        "tokens one step may run, decodes and prefills together; a longer prompt is "
        "prefilled in chunks over several steps, so this bounds the time of a step (default "
        "0: 8192 on a GPU of 70 GiB or more, else 4096, and at least --max-num-seqs)",
        type=int,
        metavar="N",
    ),
    "block_size": Flag(
        "engine", "tokens per KV cache block (default: {default})", type=int, metavar="N"
    ),
    "seed": Flag("engine", "seed of requests that bring none (default: {default})", type=int),
    "max_num_seqs": Flag(
        "engine", "most requests decoded together (default: {default})", type=int, metavar="N"
    ),
    "num_kv_blocks": Flag(
        "engine",
        "KV cache blocks of --block-size tokens; 0 sizes the pool for max-num-seqs "
        "full-length requests, capped at half the free GPU memory or 1 GiB on CPU "
        "(default: {default})",
        type=int,
        metavar="N",
    ),
    "kernels": Flag(
        "engine",
        "the decoder's kernels: triton (fused norms, RoPE with the KV write, SiLU-and-multiply "
        "and split-K paged decode attention; CUDA), torch (plain PyTorch ops, the reference) "
        "or auto, triton on CUDA in bfloat16/float16; q4: 4-bit GEMMs, a rescored 8-bit head "
        "and fused loops on a CPU for 4-bit (Q4_1) weights such as the embedded model's, "
        "float32 activations (default: {default})",
        choices=KERNEL_CHOICES,
    ),
    "overlap_decode": Flag(
        "engine",
        "launch each greedy decode step before the host has read the last one's tokens, so "
        "scheduling and detokenizing overlap the device's work (same tokens): auto does on "
        "CUDA with one rank, on does on a CPU too, off never (default: {default})",
        choices=OVERLAP_CHOICES,
    ),
    "prefix_caching": Flag(
        "engine",
        "prefill every prompt whole: no reuse of the KV blocks of a prefix another request "
        "already computed",
        switch=True,
        no_=True,
    ),
    "gpu_memory_utilization": Flag(
        "engine",
        "the share of the GPU's whole memory the engine may hold, its KV pool sized to what "
        "the weights leave of it, as vLLM's flag; 0 sizes the pool by the free memory (see "
        "--num-kv-blocks) (default: {default})",
        type=float,
        metavar="F",
    ),
    "tensor_parallel_size": Flag(
        "engine",
        "ranks of tensor parallelism, one process and one GPU each; rank 0 serves, every rank "
        "follows its graph decisions (docs/parallel.md) (default: {default})",
        type=int,
        metavar="N",
    ),
    "collective_timeout_s": Flag(
        "engine",
        "seconds a rank waits on the others before serving ends with an error (default: {default})",
        type=float,
        metavar="S",
    ),
    "enforce_eager": Flag(
        "engine", "run decode and prefill eagerly, never through CUDA graphs", switch=True
    ),
    "graph_backend": Flag(
        "engine",
        "auto: CUDA graphs where the capability check passes; cuda: the same, named; "
        "sim: the CPU stand-in with the same lifecycle rules, for testing (default: {default})",
        choices=("auto", "cuda", "sim"),
    ),
    "max_graph_bytes": Flag(
        "engine",
        "byte budget of the decode graphs, and separately of the segmented prefill "
        "graphs, e.g. 512MiB or 4GiB; every device byte a graph causes is charged, its own "
        "cuBLAS workspace included (default: {default} each)",
        type=parse_bytes,
        metavar="SIZE",
        show=format_bytes,
    ),
    "graph_manifest": Flag(
        "engine",
        "prewarm the decode graphs listed in this manifest (written by export()) at "
        "start; a manifest from another torch, device or model is refused and graphs start "
        "lazily",
        metavar="PATH",
    ),
    "warmup_graphs": Flag(
        "engine",
        "capture every decode graph the server can use (batch buckets up to "
        "--max-num-seqs, block-table widths up to --max-model-len) before serving, largest "
        "first within --max-graph-bytes; without it graphs are captured as traffic earns them",
        switch=True,
    ),
    "prefill_graphs": Flag(
        "engine",
        "prefill eagerly while decode uses graphs: no segmented prefill captures "
        "inside engine steps (each one delays the requests of that step)",
        switch=True,
        no_=True,
    ),
    "background_capture": Flag(
        "engine",
        "capture graphs inside the step that earns them (each capture delays that step's "
        "requests) instead of between steps, one bounded unit of work per step, while the "
        "key's steps run eagerly (capture_in_progress)",
        switch=True,
        no_=True,
    ),
    "batch_buckets": Flag(
        "engine",
        "decode batch sizes that get a graph, comma separated; other sizes pad up, "
        "and batches above the largest run eagerly (unbucketed_shape), so keep the largest >= "
        "--max-num-seqs (default: {default})",
        type=parse_buckets,
        metavar="LIST",
        show=lambda b: ",".join(str(x) for x in b),
    ),
    "host": Flag("server", "address to listen on (default: {default})"),
    "port": Flag("server", "port to listen on (default: {default})", type=int),
    "served_model_name": Flag(
        "server", "model id clients send (default: the model's name)", metavar="NAME"
    ),
    "log_level": Flag("server", "(default: {default})", choices=LOG_LEVELS),
    "api_key": Flag(
        "server",
        "require 'Authorization: Bearer KEY' on every route but /health and /metrics, KEY one "
        "of these, comma separated (one per tenant); the environment variable "
        f"{API_KEY_ENV} sets them without showing them in the process list (default: none)",
        metavar="KEY[,KEY...]",
    ),
    "prefix_cache_isolation": Flag(
        "server",
        "whose cached prompt prefixes a request may reuse: key, only those of its own API key "
        "(and cache_salt), so that one key cannot time what another sent; shared, any "
        "request's of its cache_salt (default: {default})",
        choices=("key", "shared"),
    ),
    "allowed_hosts": Flag(
        "server",
        "Host header names to answer besides the loopback ones, comma separated; on a "
        "loopback --host only those are answered (against DNS rebinding), on another --host "
        "any name is unless this lists them (default: {default})",
        type=parse_hosts,
        metavar="LIST",
        show=lambda hosts: ",".join(hosts) or "none",
    ),
    "max_request_bytes": Flag(
        "server",
        "largest request body, e.g. 4MiB; a larger one gets 413 before it is read in full "
        "(default: {default})",
        type=parse_bytes,
        metavar="SIZE",
        show=format_bytes,
    ),
    "header_timeout_s": Flag(
        "server",
        "seconds a client may take to send a request's headers, from connecting or from the "
        "first byte of a later request; then 408, or a close if nothing came (default: {default})",
        type=float,
        metavar="SECONDS",
    ),
    "body_timeout_s": Flag(
        "server",
        "seconds a client may take to send a request's whole body once its headers are in; "
        "then 408 (default: {default})",
        type=float,
        metavar="SECONDS",
    ),
    "switch_interval_ms": Flag(
        "server",
        "the interpreter's thread switch interval: how long the event loop may wait for the "
        "engine thread to let it run (default: {default})",
        type=float,
        metavar="MS",
    ),
    "permissive": Flag(
        "server",
        "ignore request fields this server does not know (each logged), as vLLM does, "
        "instead of answering 400 with their names",
        switch=True,
    ),
    "generation_config": Flag(
        "server",
        "the sampling defaults of what a request does not set: auto reads the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens), vllm uses none, a folder reads its file (default: {default})",
        metavar="auto|vllm|FOLDER",
    ),
    "chat_template": Flag(
        "server",
        "a Jinja chat template, or a file holding one, in place of the model's",
        metavar="TEMPLATE",
    ),
    "tool_call_parser": Flag(
        "server",
        "the format the model writes tool calls in: hermes (<tool_call> blocks: Hermes, Qwen, "
        "SmolLM) or llama3_json; auto reads it from the chat template (default: {default})",
        metavar="auto|hermes|llama3_json",
    ),
    "api_server_count": Flag(
        "server",
        "HTTP server processes over the one engine process, sharing the port: each feeds its "
        "share of the streams, so the server keeps up with the engine at many streams "
        "(vLLM's flag) (default: {default})",
        type=int,
        metavar="N",
    ),
    "engine_process": Flag(
        "server",
        "step the engine on a thread of the server's process instead of in a process of its "
        "own (for debugging: HTTP work then shares the engine's interpreter lock)",
        switch=True,
        no_=True,
    ),
}

# fields that are settings of the Python API only, and why
NOT_FLAGS = {
    "graphs": "the GraphConfig: its fields are flags by their GRAPH_SETTINGS names",
    "engine": "the EngineConfig: its fields are flags",
    "graceful_shutdown_s": "how long SIGTERM waits for open responses; fixed for the server",
    "verify": "parity before admission stays exact in the server (GraphConfig in Python)",
    "reverify_every": "periodic re-verification is a testing aid (GraphConfig in Python)",
    "capture_warmups": "warm-ups before a capture: one, as the kernels compile at start "
    "(GraphConfig in Python)",
    "admission": "admission tuning is an AdmissionConfig object (GraphConfig in Python)",
    "prefill_admission": "admission tuning is an AdmissionConfig object (GraphConfig in Python)",
    "capture_pacing": "pacing of captures between steps is a CapturePacing object (GraphConfig "
    "in Python)",
    "price_captures": "a lazy start captures a ladder of keys a pad factor apart (GraphConfig "
    "in Python)",
    "decode_pad_factor": "how far a decode batch may pad up to a larger graph (GraphConfig in "
    "Python)",
    "row_pad_factor": "how far a prefill as rows may pad up to a larger graph (GraphConfig in "
    "Python)",
}
_GRAPH_FIELD_SETTING = {field: setting for setting, field in GRAPH_SETTINGS.items()}


def setting_names() -> list[str]:
    """Every setting of the config dataclasses, in the flat names the flags use."""
    names = [f.name for f in fields(EngineConfig)] + [f.name for f in fields(ServerConfig)]
    names += [_GRAPH_FIELD_SETTING.get(f.name, f.name) for f in fields(GraphConfig)]
    return names


def default_of(name: str) -> Any:
    if name in GRAPH_SETTINGS:
        return getattr(_ENGINE.graphs, GRAPH_SETTINGS[name])
    return getattr(_ENGINE if hasattr(_ENGINE, name) else _SERVER, name)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per entry of FLAGS, in groups; every setting must have one or a reason."""
    missing = [n for n in setting_names() if n not in FLAGS and n not in NOT_FLAGS]
    if missing:
        raise RuntimeError(f"settings without a flag or a reason in NOT_FLAGS: {missing}")
    groups = {name: parser.add_argument_group(name) for name in ("model", "engine", "server")}
    for name, flag in FLAGS.items():
        _add_flag(groups[flag.group], name, flag)
    add_prefix_caching_aliases(groups["engine"])
    add_vllm_flags(parser)


def _add_flag(group: argparse._ArgumentGroup, name: str, flag: Flag) -> None:
    default = default_of(name)
    shown = flag.show(default_of(name)) if default_of(name) is not None else "none"
    spelled = ("--no-" if flag.no_ else "--") + name.replace("_", "-")
    options: dict[str, Any] = dict(dest=name, default=default, help=flag.help.format(default=shown))
    if flag.switch:
        options["action"] = "store_false" if flag.no_ else "store_true"
    else:
        options.update(type=flag.type, metavar=flag.metavar, choices=flag.choices)
    group.add_argument(spelled, *alias_options(spelled), **options)


def configs_from_args(args: argparse.Namespace) -> ServerConfig:
    """The frozen ServerConfig (with its EngineConfig) that `args` describe; ValueError naming
    what they give that cannot be served (vLLM's flags among them)."""
    checked_vllm_flags(args)
    values = {name: getattr(args, name) for name in FLAGS}
    if values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    server_fields = {f.name for f in fields(ServerConfig)}
    server = {k: v for k, v in values.items() if k in server_fields}
    engine = engine_config(**{k: v for k, v in values.items() if k not in server_fields})
    return ServerConfig(**server, engine=engine)
