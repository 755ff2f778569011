"""`graphguard serve` as a vLLM user types it: `serve MODEL`, vLLM's spellings and values of
its flags, the flags it refuses with a reason; and a start that fails before the weights load,
in one line: a port in use, a model that is not there, a context longer than the model's."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from graphguard.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, model_len
from graphguard.server.cli import build_parser, config_from_args
from graphguard.server.config import ServerConfig
from graphguard.server.vllm_flags import ACCEPTED, ALIASES, ONE_VALUE, REFUSED, SAME_AS_MODEL

ROOT = Path(__file__).resolve().parents[2]


def _config(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_vllms_spellings_reach_the_same_settings() -> None:
    config = _config(
        "/models/qwen3", "-tp", "2", "--dtype", "half", "--no-enable-prefix-caching",
        "--uvicorn-log-level", "debug", "--enable-auto-tool-choice", "--disable-log-requests",
        "--kv-cache-dtype", "auto", "--max-logprobs", "20",
    )  # fmt: skip
    assert config.engine.model == "/models/qwen3" and config.engine.tensor_parallel_size == 2
    assert config.engine.dtype == "float16" and config.engine.prefix_caching is False
    assert config.log_level == "debug"
    assert _config("--enable-prefix-caching").engine.prefix_caching is True
    assert _config("--dtype", "bf16").engine.dtype == "bfloat16"
    assert _config("--dtype", "float").engine.dtype == "float32"
    assert _config("model.gguf", "--quantization", "gguf").engine.model == "model.gguf"
    assert _config("/m", "--tokenizer", "/m/").engine.model == "/m"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["a.gguf", "--model", "b.gguf"], "given twice"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: only auto"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: only 1"),
        (["--swap-space", "4"], "--swap-space is not supported: preempted"),
        (["--lora-modules", "a=/x", "b=/y"], "--lora-modules is not supported"),
        (["/m", "--tokenizer", "/other"], "--tokenizer /other"),
        (["/m", "--quantization", "awq"], "--quantization awq"),
    ],
)
def test_what_graphguard_cannot_serve_is_refused_naming_the_flag_and_why(
    argv: list[str], words: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        _config(*argv)


def test_every_vllm_flag_is_in_the_docs_table() -> None:
    table = (ROOT / "docs" / "serving.md").read_text()
    flags = [*ALIASES, *ACCEPTED, *ONE_VALUE, *SAME_AS_MODEL, *REFUSED, "--api-server-count"]
    missing = [flag for flag in flags if f"`{flag}" not in table]
    assert missing == []


def test_the_help_lists_vllms_flags() -> None:
    text = build_parser().format_help()
    assert all(flag in text for flag in [*ACCEPTED, *ONE_VALUE, *REFUSED, "-tp"])


def test_a_context_longer_than_the_models_is_refused_and_none_asked_is_the_models() -> None:
    assert model_len(EngineConfig(), 8192) == DEFAULT_MAX_MODEL_LEN
    assert model_len(EngineConfig(), 512) == 512
    assert model_len(EngineConfig(max_model_len=8192), 8192) == 8192
    with pytest.raises(ValueError, match="longer than the model's context of 8192"):
        model_len(EngineConfig(max_model_len=100_000), 8192)


def _serve(*argv: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "graphguard.server.cli", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stderr + done.stdout


def test_a_port_in_use_fails_the_start_in_one_line_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = _serve("--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in output
    assert "loading" not in output and "Traceback" not in output


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["/no/such/model"], "neither 'embedded', a folder, nor an existing .gguf file"),
        (["--max-model-len", "100000"], "longer than the model's context of 8192 tokens"),
    ],
)
def test_a_model_that_cannot_serve_the_flags_fails_in_one_line(argv: list[str], words: str) -> None:
    code, output = _serve(*argv, "--port", "0")
    assert code == 2 and words in output
    assert "Traceback" not in output and "loading" not in output


def test_the_port_check_of_tools_serve_answers_at_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [str(ROOT / "tools" / "serve"), "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2 and "cannot listen" in done.stderr
    assert "loading" not in done.stderr  # said before graphguard starts at all
