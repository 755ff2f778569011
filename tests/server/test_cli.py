"""`graphguard serve`: flags default to the config dataclasses; a real process serves and
shuts down cleanly on SIGTERM, ending in-flight streams."""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import psutil
import pytest

from graphguard.server.cli import build_parser, config_from_args, main
from graphguard.server.config import API_KEY_ENV, ServerConfig
from graphguard.server.flags import FLAGS, NOT_FLAGS, setting_names
from graphguard.server.http_process import ENGINE_LOST_STATUS, prepare_interpreter, uvicorn_config
from graphguard.server.timeouts import HeaderTimeoutProtocol

from .helpers import MODEL, BackgroundStream, free_port, wait_for


def test_every_config_setting_is_a_flag_or_says_why_not() -> None:
    # EngineConfig, GraphConfig (by its flat names) and ServerConfig, read from the dataclasses
    names = setting_names()
    assert {"max_model_len", "max_graph_bytes", "prefill_graphs", "host"} <= set(names)
    assert all(name in FLAGS or NOT_FLAGS.get(name) for name in names)
    assert not set(FLAGS) - set(names)  # and no flag names a setting that does not exist


def test_help_lists_every_flag() -> None:
    text = build_parser().format_help()
    for name in FLAGS:
        spelled = name.replace("_", "-")
        assert f"--{spelled}" in text or f"--no-{spelled}" in text, name


def test_no_flags_give_the_default_server_config() -> None:
    assert config_from_args(build_parser().parse_args([])) == ServerConfig()


def test_flags_reach_the_engine_config() -> None:
    args = ["--batch-buckets", "1,2,8", "--max-graph-bytes", "512MiB", "--enforce-eager"]
    graphs = config_from_args(build_parser().parse_args(args)).engine.graphs
    assert graphs.batch_buckets == (1, 2, 8)
    assert graphs.max_bytes == 512 << 20
    assert graphs.enforce_eager is True
    assert graphs.warmup is False
    warm = config_from_args(build_parser().parse_args(["--warmup-graphs"])).engine.graphs
    assert warm.warmup is True
    assert graphs.prefill is True
    no_prefill = config_from_args(build_parser().parse_args(["--no-prefill-graphs"]))
    assert no_prefill.engine.graphs.prefill is False
    sim = config_from_args(build_parser().parse_args(["--graph-backend", "sim"]))
    assert sim.engine.graphs.backend == "sim"


def test_unsorted_batch_buckets_are_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--batch-buckets", "4,2"])


@contextmanager
def serving(*flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`graphguard serve` with a small KV pool and `flags`, once healthy, killed if it is
    still running at the end."""
    port = free_port()
    command = [
        sys.executable, "-m", "graphguard.server.cli", "--port", str(port),
        "--max-model-len", "512", "--num-kv-blocks", "64", *flags,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _is_healthy(base_url), timeout_s=90), "serve never got healthy"
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture()
def serve_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    with serving("--max-num-seqs", "4") as launched:
        yield launched


def _is_healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_serve_answers_health_then_exits_zero_on_sigterm(
    serve_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, _ = serve_process
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0
    log = process.stdout.read() if process.stdout else ""
    assert "decode graphs:" in log and "KV cache:" in log
    assert "access: no API key, Host in 127.0.0.1, ::1, localhost" in log


def test_sigterm_ends_an_in_flight_stream_with_abort(
    serve_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, base_url = serve_process
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    stream = BackgroundStream(f"{base_url}/v1/completions", body)
    assert stream.first_line.wait(30)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0
    stream.ended(10)
    lines = stream.lines
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"


def test_a_setting_the_config_refuses_is_a_usage_error_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--max-num-seqs", "0"])
    assert exit_info.value.code == 2
    assert "max_num_seqs must be positive" in capsys.readouterr().err


def test_a_long_context_keeps_the_step_token_budget():
    # Prompts longer than a step's budget are prefilled in chunks.
    config = config_from_args(build_parser().parse_args(["--max-model-len", "8192"]))
    assert config.engine.max_model_len == 8192
    assert config.engine.max_num_batched_tokens == 0  # the engine's, by its device
    named = config_from_args(build_parser().parse_args(["--max-num-batched-tokens", "2048"]))
    assert named.engine.max_num_batched_tokens == 2048


def test_the_api_key_comes_from_the_environment_unless_the_flag_gives_one(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    assert config_from_args(build_parser().parse_args([])).api_key == "sk-from-env"
    flag = config_from_args(build_parser().parse_args(["--api-key", "sk-flag"]))
    assert flag.api_key == "sk-flag"
    monkeypatch.setenv(API_KEY_ENV, "")  # set but empty: no key
    assert config_from_args(build_parser().parse_args([])).api_key is None


def test_an_empty_api_key_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--api-key", " "])
    assert exit_info.value.code == 2
    assert "api_key must not be empty" in capsys.readouterr().err


def test_access_flags_reach_the_server_config():
    args = ["--allowed-hosts", "API.example, gpu-box", "--max-request-bytes", "1MiB"]
    config = config_from_args(build_parser().parse_args(args))
    assert config.allowed_hosts == ("api.example", "gpu-box")
    assert config.max_request_bytes == 1 << 20
    assert ServerConfig().max_request_bytes == 4 << 20


def test_deadline_flags_reach_the_server_config_and_uvicorn(capsys):
    args = ["--header-timeout-s", "2.5", "--body-timeout-s", "30"]
    config = config_from_args(build_parser().parse_args(args))
    assert (config.header_timeout_s, config.body_timeout_s) == (2.5, 30.0)
    protocol = uvicorn_config(object(), config).http
    assert isinstance(protocol, functools.partial)
    assert protocol.func is HeaderTimeoutProtocol
    assert protocol.keywords == {"header_timeout_s": 2.5}
    with pytest.raises(SystemExit):
        main(["--body-timeout-s", "0"])
    assert "body_timeout_s must be positive" in capsys.readouterr().err


def test_the_switch_interval_flag_sets_the_interpreters_once_serving(capsys):
    config = config_from_args(build_parser().parse_args(["--switch-interval-ms", "0.25"]))
    assert config.switch_interval_ms == 0.25
    assert ServerConfig().switch_interval_ms == 0.5
    previous = sys.getswitchinterval()
    try:
        prepare_interpreter(config)
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
    finally:
        sys.setswitchinterval(previous)
        gc.unfreeze()
    with pytest.raises(SystemExit):
        main(["--switch-interval-ms", "0"])
    assert "switch_interval_ms must be positive" in capsys.readouterr().err


def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (not multiprocessing's tracker)."""
    children = psutil.Process(server_pid).children()
    for child in children:
        if not any("resource_tracker" in part for part in child.cmdline()):
            return int(child.pid)
    raise AssertionError(f"no engine process among {children}")


def test_a_dead_engine_process_answers_503s_and_the_server_exits_non_zero(
    serve_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, base_url = serve_process
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True}
    stream = BackgroundStream(f"{base_url}/v1/completions", {**body, "stream": True})
    assert stream.first_line.wait(30)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{base_url}/v1/completions", json=body, timeout=30)
        time.sleep(0.5)  # admitted, generating
        os.kill(_engine_pid(process.pid), signal.SIGKILL)
        answer = waiting.result()
    assert answer.status_code == 503 and "engine process exited" in answer.text
    assert stream.ended(10) and stream.lines[-1] == "data: [DONE]"  # no request hangs
    assert process.wait(timeout=10) == ENGINE_LOST_STATUS  # for its supervisor to restart


def _is_running(process: psutil.Process) -> bool:
    try:  # NOTE: a zombie has exited; its reaping is its new parent's
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def test_api_server_processes_share_the_port_and_stop_with_the_first() -> None:
    flags = ("--api-server-count", "2", "--max-num-seqs", "16", "--num-kv-blocks", "128")
    with serving(*flags) as (process, base_url):
        children = psutil.Process(process.pid).children()
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 300, "ignore_eos": True}
        os.kill(process.pid, signal.SIGSTOP)  # the first process takes no connection
        try:
            answer = httpx.post(
                f"{base_url}/v1/completions", json={**body, "max_tokens": 4}, timeout=60
            )
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        finally:
            os.kill(process.pid, signal.SIGCONT)
        streams = [
            BackgroundStream(f"{base_url}/v1/completions", {**body, "stream": True})
            for _ in range(8)
        ]
        assert all(stream.first_line.wait(60) for stream in streams)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert all(stream.ended_cleanly(10) for stream in streams), [s.error for s in streams]
        assert wait_for(lambda: not any(_is_running(child) for child in children), timeout_s=10)
