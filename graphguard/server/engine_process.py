"""The engine's side of the engine process: build the engine, then step it and talk to the server.

`engine_process_main` runs in a process of its own (started by engine_client.py with the
"spawn" context), so that the step loop never waits for the server's interpreter lock: HTTP
parsing, tokenizing and SSE framing run in the server process, steps and detokenizing here.
Under tensor parallelism this process is rank 0 and starts the other ranks itself.

Two threads: a receiver reads commands off the pipe (and answers queries at once, as they
take the graphs' locks, not the engine's), the step loop applies the others between steps,
like the in-process AsyncEngine's thread does, and sends one `StepOutputs` a step.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from graphguard.engine.config import EngineConfig
from graphguard.engine.engine import LLMEngine
from graphguard.server import engine_messages as m

logger = logging.getLogger("graphguard.server")


def build_engine(config: EngineConfig) -> LLMEngine:
    """One process's engine, or rank 0's of `tensor_parallel_size` ranks (the others start
    as child processes and end with it)."""
    from graphguard.engine.launch.spawn import start_ranks

    if config.tensor_parallel_size == 1:
        return LLMEngine(config)
    return start_ranks(config)[0]


def add_requests(engine: LLMEngine, requests: Sequence[m.EngineRequest]) -> None:
    """Add every one of `requests` to `engine`, or none: when one fails, those added before it
    are aborted and the error raised. (No step has run since they were added, so none of them
    produced a token.) Images and forks are passed only when present, so engines without them
    keep working."""
    added: list[str] = []
    try:
        for request in requests:
            extra: dict[str, Any] = {"images": request.images} if request.images else {}
            if request.fork_of is not None:
                extra["fork_of"] = request.fork_of
            engine.add_request(
                request.request_id, request.prompt_token_ids, request.params, **extra
            )
            added.append(request.request_id)
    except Exception:
        for request_id in added:
            engine.abort_request(request_id)
        raise


def engine_info(engine: LLMEngine, pid: int) -> m.EngineInfo:
    """What the server reads of `engine` once (picklable: it crosses the pipe)."""
    vision = engine.vision
    spec = None
    if vision is not None:
        spec = m.VisionSpec(vision.config, engine.model_config.hidden_size, vision.image_token_id)
    return m.EngineInfo(
        pid=pid,
        tokenizer=engine.tokenizer,
        model_config=engine.model_config,
        max_model_len=engine.max_model_len,
        block_size=engine.config.block_size,
        stats=dict(engine.stats()),
        vision=spec,
        description=describe_engine(engine),
        has_graph_metrics=engine.graph_registry is not None,
        model_folder=None if engine.loaded.folder is None else str(engine.loaded.folder),
    )


def describe_engine(engine: LLMEngine) -> list[str]:
    """Startup lines: device, dtype, KV blocks, kernels, and whether decode graphs are on."""
    stats, config = engine.stats(), engine.config
    dtype = str(engine.dtype).removeprefix("torch.")
    kv = (
        f"{stats.get('kv_blocks_total', '?')} blocks x {config.block_size} tokens "
        f"({stats.get('kv_bytes', 0) / (1 << 20):.0f} MiB)"
    )
    graphs = engine.graphs
    if graphs is None:
        graph_line = f"decode graphs: off ({engine.graphs_off_reason})"
    else:
        graph_line = f"decode graphs: on ({graphs.enabled_reason})"
    return [
        f"device: {engine.device}, dtype: {dtype}, max model len: {engine.max_model_len}",
        f"KV cache: {kv}, max num seqs: {config.max_num_seqs}, "
        f"step budget: {engine.step_tokens} tokens",
        f"kernels: {engine.kernels.describe()}",
        graph_line,
    ]


def engine_process_main(conn: Connection, config: EngineConfig, log_level: str) -> None:
    """The engine process: build the engine, say `EngineReady` (or `EngineFailed`), then serve
    commands until `Shutdown` or until the server's end of the pipe closes."""
    # NOTE: Ctrl-C reaches the whole process group; the server decides when the engine ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine = build_engine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which exits with it
        logger.exception("the engine could not start")
        conn.send_bytes(m.encode(m.EngineFailed(str(exc), isinstance(exc, ValueError))))
        return
    conn.send_bytes(m.encode(m.EngineReady(engine_info(engine, os.getpid()))))
    EngineLoop(engine, conn).run()


class EngineLoop:
    """Steps one engine and exchanges messages with the server over `conn`."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self._engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()  # the receiver answers queries while steps send
        self._inbox: queue.SimpleQueue[m.Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._live: set[str] = set()  # admitted, not finished: the ids an abort-all reaches
        self._receiver = threading.Thread(target=self._receive, name="engine-inbox", daemon=True)

    def run(self) -> None:
        self._receiver.start()
        try:
            self._serve()
        except Exception:
            logger.exception("the engine loop stopped on an unexpected error")
        finally:
            self._engine.shutdown()
            self._send(m.EngineStopped())

    def _send(self, message: m.EngineMessage) -> None:
        data = m.encode(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError:  # the server is gone; the receiver ends the loop
            pass

    # ---- receiver thread ---------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                command = m.decode(self._conn.recv_bytes())
                if isinstance(command, m.Query):
                    self._answer(command)
                    continue
                self._inbox.put(command)
                self._wakeup.set()
                if isinstance(command, m.Shutdown):
                    return
        except (EOFError, OSError):  # the server process has gone: stop with it
            self._inbox.put(m.Shutdown())
            self._wakeup.set()

    def _answer(self, query: m.Query) -> None:
        try:
            value: Any
            if query.kind is m.QueryKind.GRAPHS_REPORT:
                value = self._engine.graphs_report()
            else:
                registry = self._engine.graph_registry
                value = None if registry is None else list(registry.collect())
            self._send(m.Reply(query.ticket, value))
        except Exception as exc:  # noqa: BLE001 - handed back to the server
            self._send(m.Reply(query.ticket, None, error=f"{type(exc).__name__}: {exc}"))

    # ---- step loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        engine = self._engine
        while True:
            # NOTE: clear before draining: a command sent after the drain sets the event
            # again, so the wait below cannot sleep through it.
            self._wakeup.clear()
            if not self._apply_commands():
                return
            # NOTE: a graph capture in flight advances one unit per step: idle steps finish it.
            if engine.has_unfinished_requests() or engine.has_capture_in_flight():
                self._step()
            else:
                self._wakeup.wait()

    def _apply_commands(self) -> bool:
        """Apply the commands received; False on Shutdown. Sends the stats after them."""
        num_applied = 0
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, m.Shutdown):
                return False
            if isinstance(command, m.AddRequests):
                self._add(command)
            elif isinstance(command, m.AbortRequests):
                self._abort(command.request_ids)
            num_applied += 1
        if num_applied:  # an abort frees KV at once: /metrics shows it without a step
            self._send(m.StepOutputs([], dict(self._engine.stats()), is_step=False))
        return True

    def _add(self, command: m.AddRequests) -> None:
        try:
            add_requests(self._engine, command.requests)
        except Exception as exc:  # noqa: BLE001 - handed back to the server, not swallowed
            param = getattr(exc, "param", None)
            is_invalid = isinstance(exc, ValueError)
            self._send(m.Admitted(command.ticket, str(exc), is_invalid, param))
            return
        self._live.update(request.request_id for request in command.requests)
        self._send(m.Admitted(command.ticket))

    def _abort(self, request_ids: list[str] | None) -> None:
        # The server has ended these streams already; what is left is to free their KV.
        for request_id in list(self._live) if request_ids is None else request_ids:
            if request_id in self._live:
                self._live.discard(request_id)
                self._engine.abort_request(request_id)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing its %d requests", len(self._live))
            self._fail_all(str(exc))
            return
        rows = []
        for output in outputs:
            if output.request_id not in self._live:
                continue  # aborted: the server ended its stream already
            if output.finished:
                self._live.discard(output.request_id)
            rows.append(m.output_row(output))
        self._send(m.StepOutputs(rows, dict(self._engine.stats()), is_step=True))

    def _fail_all(self, error: str) -> None:
        """End every request after a step error: free what can be freed, tell the server."""
        failed, self._live = list(self._live), set()
        for request_id in failed:
            try:
                self._engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine is already failing; keep going
                logger.exception("abort of %s failed after a step error", request_id)
        stats = dict(self._engine.stats())
        self._send(m.StepOutputs([], stats, is_step=True, failed=failed, error=error))
