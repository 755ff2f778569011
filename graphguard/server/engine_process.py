"""The engine's side of the engine process: build the engine, then step it and talk to the server.

`engine_process_main` runs in a process of its own (started by engine_client.py with the
"spawn" context), so that the step loop never waits for the server's interpreter lock: HTTP
parsing, tokenizing and SSE framing run in the server process, steps and detokenizing here.
Under tensor parallelism this process is rank 0 and starts the other ranks itself.

Two threads: a receiver reads commands off the pipe (and answers queries at once, as they
take the graphs' locks, not the engine's), the step loop applies the others between steps,
like the in-process AsyncEngine's thread does, and sends one `StepOutputs` a step to each API
server process with outputs in it (the others get the stats at most every STATS_INTERVAL_S).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
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


def engine_process_main(conns: list[Connection], config: EngineConfig, log_level: str) -> None:
    """The engine process: build the engine, say `EngineReady` (or `EngineFailed`) to every
    server process, then serve their commands until the first one's `Shutdown`, or until its
    end of the pipe closes. (`conns`: one pipe per API server process, the first the one that
    started this process.)"""
    # NOTE: Ctrl-C reaches the whole process group; the server decides when the engine ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine = build_engine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which exits with it
        # the server says why in one line; the traceback is for --log-level debug
        logger.debug("the engine could not start", exc_info=True)
        conns[0].send_bytes(m.encode(m.EngineFailed(str(exc), isinstance(exc, ValueError))))
        return
    ready = m.encode(m.EngineReady(engine_info(engine, os.getpid())))
    for conn in conns:
        conn.send_bytes(ready)
    EngineLoop(engine, conns).run()


STATS_INTERVAL_S = 0.1


class EngineLoop:
    """Steps one engine and exchanges messages with the API server processes over `conns`:
    each request's outputs go to the server that added it; every server gets the stats."""

    def __init__(self, engine: LLMEngine, conns: list[Connection]) -> None:
        self._engine = engine
        self._conns: dict[int, Connection] = dict(enumerate(conns))  # the open ones
        self._send_lock = threading.Lock()  # the receivers answer queries while steps send
        self._inbox: queue.SimpleQueue[tuple[int, m.Command]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # admitted, not finished, by id: the server that added each (what an abort-all reaches)
        self._live: dict[str, int] = {}
        self._stats_sent: dict[int, float] = {}  # when each server last got a step's message
        self._receivers = [
            threading.Thread(target=self._receive, args=(i,), name=f"engine-inbox-{i}", daemon=True)
            for i in self._conns
        ]

    def run(self) -> None:
        for receiver in self._receivers:
            receiver.start()
        try:
            self._serve()
        except Exception:
            logger.exception("the engine loop stopped on an unexpected error")
        finally:
            self._engine.shutdown()
            self._send_all(m.EngineStopped())

    def _send(self, server: int, message: m.EngineMessage) -> None:
        conn = self._conns.get(server)
        if conn is None:
            return
        data = m.encode(message)
        try:
            with self._send_lock:
                conn.send_bytes(data)
        except OSError:  # that server is gone; its receiver tells the loop
            pass

    def _send_all(self, message: m.EngineMessage) -> None:
        for server in list(self._conns):
            self._send(server, message)

    # ---- receiver threads --------------------------------------------------------------------

    def _receive(self, server: int) -> None:
        conn = self._conns[server]
        try:
            while True:
                command = m.decode(conn.recv_bytes())
                if isinstance(command, m.Query):
                    self._answer(server, command)
                    continue
                self._put(server, command)
                if isinstance(command, m.Shutdown):
                    return
        except (EOFError, OSError):  # that server process has gone
            self._put(server, m.Shutdown())

    def _put(self, server: int, command: m.Command) -> None:
        self._inbox.put((server, command))
        self._wakeup.set()

    def _answer(self, server: int, query: m.Query) -> None:
        try:
            value: Any
            if query.kind is m.QueryKind.GRAPHS_REPORT:
                value = self._engine.graphs_report()
            else:
                registry = self._engine.graph_registry
                value = None if registry is None else list(registry.collect())
            self._send(server, m.Reply(query.ticket, value))
        except Exception as exc:  # noqa: BLE001 - handed back to the server
            self._send(server, m.Reply(query.ticket, None, error=f"{type(exc).__name__}: {exc}"))

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
        """Apply the commands received; False on the first server's Shutdown (another's ends
        its requests and its pipe). Sends the stats after them."""
        num_applied = 0
        while True:
            try:
                server, command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, m.Shutdown):
                if server == 0:
                    return False
                self._abort(server, None)
                self._conns.pop(server, None)
            elif isinstance(command, m.AddRequests):
                self._add(server, command)
            elif isinstance(command, m.AbortRequests):
                self._abort(server, command.request_ids)
            num_applied += 1
        if num_applied:  # an abort frees KV at once: /metrics shows it without a step
            self._send_all(m.StepOutputs([], dict(self._engine.stats()), is_step=False))
        return True

    def _add(self, server: int, command: m.AddRequests) -> None:
        try:
            add_requests(self._engine, command.requests)
        except Exception as exc:  # noqa: BLE001 - handed back to the server, not swallowed
            param = getattr(exc, "param", None)
            is_invalid = isinstance(exc, ValueError)
            self._send(server, m.Admitted(command.ticket, str(exc), is_invalid, param))
            return
        self._live.update((request.request_id, server) for request in command.requests)
        self._send(server, m.Admitted(command.ticket))

    def _abort(self, server: int, request_ids: list[str] | None) -> None:
        # The server has ended these streams already; what is left is to free their KV.
        mine = [r for r, owner in self._live.items() if owner == server]
        for request_id in mine if request_ids is None else request_ids:
            if self._live.get(request_id) == server:
                del self._live[request_id]
                self._engine.abort_request(request_id)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing its %d requests", len(self._live))
            self._fail_all(str(exc))
            return
        rows: dict[int, list[m.OutputRow]] = {}
        for output in outputs:
            server = self._live.get(output.request_id)
            if server is None:
                continue  # aborted: the server ended its stream already
            if output.finished:
                del self._live[output.request_id]
            rows.setdefault(server, []).append(m.output_row(output))
        stats = dict(self._engine.stats())
        now = time.monotonic()
        for server in list(self._conns):
            # NOTE: a server without outputs this step gets the stats (for /metrics) at most
            # every STATS_INTERVAL_S: one that is slow to read, or stopped, fills its pipe with
            # steps' messages far later, and each step sends less
            server_rows = rows.get(server, [])
            if server_rows or now - self._stats_sent.get(server, 0.0) >= STATS_INTERVAL_S:
                self._stats_sent[server] = now
                self._send(server, m.StepOutputs(server_rows, stats, is_step=True))

    def _fail_all(self, error: str) -> None:
        """End every request after a step error: free what can be freed, tell the servers."""
        failed, self._live = self._live, {}
        for request_id in failed:
            try:
                self._engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine is already failing; keep going
                logger.exception("abort of %s failed after a step error", request_id)
        stats = dict(self._engine.stats())
        for server in list(self._conns):
            ids = [request_id for request_id, owner in failed.items() if owner == server]
            self._send(server, m.StepOutputs([], stats, is_step=True, failed=ids, error=error))
