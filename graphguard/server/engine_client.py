"""The server's side of the engine process: the asyncio-facing engine when the engine runs in a
process of its own (engine_process.py), with the interface of the in-process AsyncEngine.

Everything but `shutdown` and the graph metrics runs on the event loop's thread: the loop reads
the pipe itself (`add_reader`), so a step's outputs reach their streams with no thread in
between, and each stream adds up its own text. Commands go through a sender thread, so that a
large one (images, a long prompt) never blocks the loop while the engine is busy stepping.

If the engine process dies, every open stream fails with `EngineLostError`, new requests get
`EngineClosedError` (503) and /health answers 503: an error, never a hang.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from graphguard.engine.config import EngineConfig
from graphguard.engine.models.vision import VisionEncoder
from graphguard.server import engine_messages as m
from graphguard.server.async_engine import EngineClosedError, RequestStream, aborted_output
from graphguard.server.engine_process import engine_process_main

logger = logging.getLogger("graphguard.server")
MAX_MESSAGES_PER_READ = 64  # then the loop runs other callbacks before reading on


class EngineLostError(EngineClosedError):
    """The engine process exited while the server still needed it (a 503, as a server that
    is closing answers)."""


class RequestRefused(ValueError):
    """The engine refused a request (a 400); `param` names the parameter when known."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class EngineProcessClient:
    """One engine process, from the server's side. `launch` starts it and waits until its
    engine is built; `start` (on the event loop) begins serving."""

    def __init__(self, process: Any, conn: Any, info: m.EngineInfo) -> None:
        self._process = process  # None in an API server process that attached to it
        self._conn = conn
        self.other_pipes: list[Any] = []  # for the other API server processes (launch)
        self.info = info
        self._vision = _vision_settings(info.vision)
        self._stats = info.stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # admitted and not finished
        self._admissions: dict[int, tuple[asyncio.Future[None], list[RequestStream]]] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._tickets = itertools.count()
        self._is_closing = self._is_stopping = self._is_lost = self._is_attached = False
        self.num_step_messages = 0  # StepOutputs of steps received (one per step at most)
        # called on the loop once the engine process is lost (the server then exits, cli.py)
        self.on_lost: Callable[[], None] | None = None
        self._outbox: queue.SimpleQueue[m.Command | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_commands, name="engine-outbox")
        self._sender.daemon = True
        self._sender.start()
        atexit.register(self._at_exit)

    @classmethod
    def launch(
        cls, config: EngineConfig, log_level: str = "info", num_servers: int = 1
    ) -> EngineProcessClient:
        """Start an engine process for `config` and wait for its engine; ValueError when it
        refuses a setting, RuntimeError when it fails otherwise. With `num_servers` above 1
        it has a pipe for each other API server process too (`other_pipes`, each for
        `attach` in that process)."""
        context = mp.get_context("spawn")
        pipes = [context.Pipe(duplex=True) for _ in range(num_servers)]
        # NOTE: not a daemon: under tensor parallelism it starts the other ranks itself.
        process = context.Process(
            target=engine_process_main,
            args=([child for _, child in pipes], config, log_level),
            name="graphguard-engine",
        )
        process.start()
        for _, child in pipes:
            child.close()  # so that its exit reads as EOF here
        conn = pipes[0][0]
        while not conn.poll(0.2):
            if not process.is_alive():
                raise RuntimeError(f"the engine process exited (code {process.exitcode})")
        first = m.decode(conn.recv_bytes())
        if isinstance(first, m.EngineFailed):
            process.join(30)
            raise (ValueError if first.is_config_error else RuntimeError)(first.message)
        client = cls(process, conn, first.info)
        client.other_pipes = [parent for parent, _ in pipes[1:]]
        return client

    @classmethod
    def attach(cls, conn: Any) -> EngineProcessClient:
        """The client of an API server process other than the one that launched the engine
        process, over its pipe (one of `other_pipes`): it serves requests but does not own
        the engine's life (its shutdown closes only its pipe)."""
        first = m.decode(conn.recv_bytes())
        assert isinstance(first, m.EngineReady), first
        return cls(None, conn, first.info)

    @property
    def pid(self) -> int:
        return self.info.pid

    # ---- the interface the endpoints use (AsyncEngine's) -------------------------------------

    def start(self) -> None:
        """Begin reading the engine's messages; on the event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        self._is_attached = True

    async def generate(self, requests: Sequence[m.EngineRequest]) -> list[RequestStream]:
        """Admit every request or none, one stream each; raises RequestRefused (a ValueError)
        when the engine refuses one, EngineClosedError once the server is closing."""
        if not self.is_running:
            raise EngineClosedError(self._closed_reason())
        streams = [RequestStream(r.request_id, len(r.prompt_token_ids)) for r in requests]
        ticket = next(self._tickets)
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._admissions[ticket] = (admitted, streams)
        self._send(m.AddRequests(ticket, list(requests)))
        try:
            await admitted
        except asyncio.CancelledError:
            self._send(m.AbortRequests([r.request_id for r in requests]))
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream ends with finish_reason "abort"."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(aborted_output(stream))
        self._send(m.AbortRequests([request_id]))

    def abort_all(self) -> None:
        """Refuse new requests and abort every admitted one (the first step of shutdown)."""
        self._is_closing = True
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(aborted_output(stream))
        self._send(m.AbortRequests(None))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step or command (a snapshot; never blocks)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        alive = self._process is None or self._process.is_alive()  # attached: the pipe tells
        return not (self._is_closing or self._is_lost) and alive

    @property
    def vision(self) -> VisionEncoder | None:
        """The vision encoder's settings and token ids (its weights stay in the engine)."""
        return self._vision

    @property
    def graph_registry(self) -> CollectorRegistry | None:
        """The graphs' metrics, fetched from the engine process when collected (off the loop)."""
        if not self.info.has_graph_metrics or not self.is_running:
            return None
        return _RemoteRegistry(lambda: self._ask_blocking(m.QueryKind.GRAPH_METRICS))

    async def graphs_report(self) -> dict[str, Any]:
        """The /v1/graphs body, answered by the engine process off its step loop."""
        report: dict[str, Any] = await self._ask(m.QueryKind.GRAPHS_REPORT)
        return report

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort everything, stop the engine process and wait for it (from any thread)."""
        if self._is_stopping:
            return
        self._is_stopping = True
        self._on_loop(self.abort_all)
        self._outbox.put(m.Shutdown())  # an attached server's ends its requests and its pipe
        self._outbox.put(None)
        if self._process is not None:
            self._process.join(timeout_s)
            if self._process.is_alive():
                logger.error("the engine process did not stop in %.0f s; terminating it", timeout_s)
                self._process.terminate()
                self._process.join(5)
        self._sender.join(5)
        self._on_loop(self._detach)
        atexit.unregister(self._at_exit)

    # ---- pipe --------------------------------------------------------------------------------

    def _send(self, command: m.Command) -> None:
        self._outbox.put(command)

    def _send_commands(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(m.encode(command))
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _on_readable(self) -> None:
        try:
            for _ in range(MAX_MESSAGES_PER_READ):
                self._handle(m.decode(self._conn.recv_bytes()))
                if not self._conn.poll():
                    return
        except (EOFError, OSError):
            self._detach()
            if not self._is_stopping:
                self._lose()

    def _handle(self, message: m.EngineMessage) -> None:
        if isinstance(message, m.StepOutputs):
            self._deliver(message)
        elif isinstance(message, m.Admitted):
            self._admitted(message)
        elif isinstance(message, m.Reply):
            self._replied(message)

    def _deliver(self, message: m.StepOutputs) -> None:
        self._stats = message.stats
        self.num_step_messages += message.is_step
        streams = self._streams
        for row in message.rows:
            stream = streams.get(row.request_id)
            if stream is None:
                continue  # aborted here while the engine stepped
            output = m.request_output(row, stream.last.text if stream.last else "")
            if output.finished:
                del streams[row.request_id]
            stream.last = output
            stream.put(output)
        for request_id in message.failed or []:
            if (stream := streams.pop(request_id, None)) is not None:
                stream.put(RuntimeError(message.error))

    def _admitted(self, message: m.Admitted) -> None:
        admitted, streams = self._admissions.pop(message.ticket)
        if message.error is not None:
            if not admitted.done():
                admitted.set_exception(
                    RequestRefused(message.error, message.param)
                    if message.is_invalid
                    else RuntimeError(message.error)
                )
            return
        self._streams.update((stream.request_id, stream) for stream in streams)
        if not admitted.done():
            admitted.set_result(None)
        if self._is_closing:  # admitted while the server began to close
            for stream in streams:
                self.abort(stream.request_id)

    def _replied(self, message: m.Reply) -> None:
        answer = self._replies.pop(message.ticket)
        if answer.done():
            return
        if message.error is not None:
            answer.set_exception(RuntimeError(message.error))
        else:
            answer.set_result(message.value)

    async def _ask(self, kind: m.QueryKind) -> Any:
        if self._is_lost:
            raise EngineLostError(self._closed_reason())
        ticket = next(self._tickets)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[ticket] = answer
        self._send(m.Query(ticket, kind))
        return await answer

    def _ask_blocking(self, kind: m.QueryKind, timeout_s: float = 30.0) -> Any:
        """`_ask` from a thread other than the loop's."""
        if self._loop is None:
            raise EngineClosedError("the engine client was never started")
        return asyncio.run_coroutine_threadsafe(self._ask(kind), self._loop).result(timeout_s)

    # ---- ends --------------------------------------------------------------------------------

    def _lose(self) -> None:
        """The engine process exited unasked: fail everyone waiting on it."""
        self._is_lost = True
        if self._process is not None:
            self._process.join(1.0)
        error = EngineLostError(self._closed_reason())
        logger.error("%s; failing %d open requests", error, len(self._streams))
        if self.on_lost is not None:
            self.on_lost()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)
        for admitted, _ in self._admissions.values():
            if not admitted.done():
                admitted.set_exception(EngineClosedError(str(error)))
        for answer in self._replies.values():
            if not answer.done():
                answer.set_exception(error)
        self._admissions.clear()
        self._replies.clear()

    def _closed_reason(self) -> str:
        if self._is_lost:
            code = "unknown" if self._process is None else self._process.exitcode
            return (
                f"the engine process exited (code {code}); the server is exiting so that its "
                "supervisor can restart it"
            )
        return "the server is shutting down"

    def _detach(self) -> None:
        if self._is_attached and self._loop is not None:
            self._is_attached = False
            self._loop.remove_reader(self._conn.fileno())
        if not self._conn.closed:
            self._conn.close()

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the event loop's thread (here, when there is none or it has closed)."""
        loop = self._loop
        if loop is None or loop.is_closed() or _is_running_loop(loop):
            fn()
            return
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed meanwhile
            fn()
            return
        done.wait(5.0)

    def _at_exit(self) -> None:
        self._loop = None  # the loop cannot run callbacks any more
        self.shutdown(timeout_s=5.0)


def _is_running_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs on this thread
        return False


class _RemoteRegistry(CollectorRegistry):
    """A registry whose metrics are another process's, fetched on each collect()."""

    def __init__(self, fetch: Callable[[], list[Metric] | None]) -> None:
        super().__init__(auto_describe=False)
        self._fetch = fetch

    def collect(self) -> Iterable[Metric]:
        yield from self._fetch() or []


def _vision_settings(spec: m.VisionSpec | None) -> VisionEncoder | None:
    """A vision encoder with the engine's settings and token ids and no weights (on the meta
    device): the server reads its settings; the engine process encodes the pixels."""
    if spec is None:
        return None
    with torch.device("meta"):
        return VisionEncoder(spec.config, spec.text_hidden_size, spec.image_token_id)
