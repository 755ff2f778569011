"""Runs LLMEngine.step() on a thread of its own and delivers outputs to asyncio consumers: the
in-process way to serve an engine (`--no-engine-process`; engine_client.py runs it in a process
of its own, the default). `RequestStream`, the stream of one request's outputs, serves both.

The engine is not thread-safe, so only the engine thread ever touches its requests, scheduler
and KV pool: the event loop sends commands (add, abort) through a queue and the thread applies
them between steps. Each request's outputs go to its own asyncio queue through
`loop.call_soon_threadsafe`, so the event loop never waits on the model. The few reads the server
needs besides (the vision encoder's settings, the graphs' report and registry) are ones the
engine documents as safe from any thread; they are the wrapper's methods, so the server never
holds the engine itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from graphguard.engine.engine import LLMEngine, RequestOutput
from graphguard.engine.models.vision import VisionEncoder
from graphguard.server.engine_messages import EngineRequest
from graphguard.server.engine_process import add_requests, engine_info
from graphguard.server.errors import EngineClosedError

logger = logging.getLogger("graphguard.server")


class RequestStream:
    """The outputs of one request, in order, ending with one whose `finished` is True.

    A reader that falls behind gets the outputs waiting for it as one (`merge_outputs`): a
    client that cannot keep up is sent one SSE event for several tokens, not one per token.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.is_finished = False
        self.last: RequestOutput | None = None  # written by the engine's side only
        self._loop = asyncio.get_running_loop()
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        deliver([(self, item)])

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand the reader `item`; on the event loop's thread only."""
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.is_finished = True
            raise item
        # NOTE: an error waiting behind outputs is raised on the next call, after them.
        while self._items and not item.finished and not isinstance(self._items[0], BaseException):
            item = merge_outputs(item, self._items.popleft())  # type: ignore[arg-type]
        self.is_finished = item.finished
        return item


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output standing for `first` followed by `then`, two outputs of one request."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return RequestOutput(
        request_id=then.request_id,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        delta_text=first.delta_text + then.delta_text,
        text=then.text,
        finished=then.finished,
        finish_reason=then.finish_reason,
        num_prompt_tokens=then.num_prompt_tokens,
        num_output_tokens=then.num_output_tokens,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs,
        error=then.error or first.error,
    )


Delivery = tuple[RequestStream, RequestOutput | BaseException]


def deliver(items: list[Delivery]) -> None:
    """Hand each stream its item from the engine thread, with one wake-up of each event loop
    for all of them (a step's outputs go in one call).

    NOTE: a wake-up is a write to the loop's socket, and that system call gives up the GIL; a
    busy event loop (requests arriving, streams ending) may keep it for a switch interval
    (5 ms) before the engine thread gets it back. One wake-up per output paid that up to once
    per request of the step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
    for stream, item in items:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, handed in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, handed)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(items: list[Delivery]) -> None:
    for stream, item in items:
        stream.put(item)


@dataclass(frozen=True)
class _Add:
    requests: list[EngineRequest]
    streams: list[RequestStream]  # one per request, in order
    accepted: Future[None]


@dataclass(frozen=True)
class _Abort:
    request_id: str | None  # None: every request


class AsyncEngine:
    """Owns the engine thread; the asyncio-facing side of one LLMEngine."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.info = engine_info(engine, os.getpid())
        self._vision = engine.vision  # set once when the engine is built; never replaced
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._stats: dict[str, Any] = {}
        self._is_closing = False
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="graphguard-engine", daemon=True)

    # ---- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        self._stats = dict(self._engine.stats())
        self._thread.start()

    async def generate(self, requests: Sequence[EngineRequest]) -> list[RequestStream]:
        """Admit every request or none, one stream each; raises the engine's ValueError when it
        refuses one (the requests added before it are aborted before any step runs them)."""
        if self._is_closing:
            raise EngineClosedError("the server is shutting down")
        streams = [RequestStream(r.request_id, len(r.prompt_token_ids)) for r in requests]
        accepted: Future[None] = Future()
        self._send(_Add(list(requests), streams, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            for request in requests:  # they may have been admitted just before we were cancelled
                self.abort(request.request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; its stream ends with finish_reason "abort"."""
        self._send(_Abort(request_id))

    def abort_all(self) -> None:
        """Refuse new requests and abort every admitted one (the first step of shutdown)."""
        self._is_closing = True
        self._send(_Abort(None))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last step or command (a snapshot; never blocks)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._is_closing

    # NOTE: the three reads below skip the engine thread: none touches requests, the scheduler
    # or the KV pool, so none needs to wait for a step to end.

    @property
    def vision(self) -> VisionEncoder | None:
        """The vision encoder (None: the model takes no images), for its settings and token
        ids only: the engine thread encodes a request's images when it admits the request."""
        return self._vision

    @property
    def graph_registry(self) -> CollectorRegistry | None:
        """The graphs' Prometheus registry, None while graphs are off or after shutdown.
        Collecting it takes the graph cache's lock: render it off the event loop."""
        return self._engine.graph_registry  # an attribute read, safe from any thread

    async def graphs_report(self) -> dict[str, Any]:
        """The /v1/graphs body (`LLMEngine.graphs_report`). It takes the graph runners' locks,
        not the engine's, so it runs on a worker thread: off the loop, and not queued behind
        a step on the engine thread."""
        return await asyncio.to_thread(self._engine.graphs_report)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort everything, stop the thread, then release the engine's graphs and KV."""
        self.abort_all()
        self._is_stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        # NOTE: on the caller's thread, once the engine thread is gone; should the join time
        # out, the engine's lifecycle lock still keeps shutdown and a step apart.
        self._engine.shutdown()

    def _send(self, command: _Add | _Abort) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    # ---- engine-thread side ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve_commands_and_steps()
        except Exception as exc:
            # A broken engine must not leave clients waiting forever.
            logger.exception("engine thread stopped on an unexpected error")
            self._is_closing = True
            self._fail_all(exc)
        finally:
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Requests sent but never taken in get an error rather than a wait without end."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(EngineClosedError("the server is shutting down"))

    def _serve_commands_and_steps(self) -> None:
        while True:
            # NOTE: clear before draining: a command sent after the drain sets the event
            # again, so the wait below cannot sleep through it.
            self._wakeup.clear()
            self._drain_inbox()
            if self._is_stopping:
                return
            # NOTE: a graph capture in flight advances one unit per step: idle steps finish it.
            if self._engine.has_unfinished_requests() or self._engine.has_capture_in_flight():
                self._step()
            else:
                self._wakeup.wait()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._add(command)
            else:
                self._abort(command.request_id)
        self._stats = dict(self._engine.stats())

    def _add(self, command: _Add) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the client went away before the requests reached the engine
        try:
            add_requests(self._engine, command.requests)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller, not swallowed
            command.accepted.set_exception(exc)
            return
        self._streams.update((stream.request_id, stream) for stream in command.streams)
        command.accepted.set_result(None)

    def _abort(self, request_id: str | None) -> None:
        ids = list(self._streams) if request_id is None else [request_id]
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is None:
                continue  # finished already, or never admitted
            self._engine.abort_request(rid)
            stream.put_threadsafe(aborted_output(stream))

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing its %d requests", len(self._streams))
            self._fail_all(exc)
            return
        handed: list[Delivery] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if output.finished:
                del self._streams[output.request_id]
            stream.last = output
            handed.append((stream, output))
        deliver(handed)
        self._stats = dict(self._engine.stats())

    def _fail_all(self, exc: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self._engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine is already failing; keep going
                logger.exception("abort of %s failed after a step error", rid)
            stream.put_threadsafe(exc)
        self._streams.clear()


def aborted_output(stream: RequestStream) -> RequestOutput:
    """The last output of an aborted request: no new token, its text so far."""
    last = stream.last
    return RequestOutput(
        request_id=stream.request_id,
        new_token_ids=[],
        delta_text="",
        text=last.text if last else "",
        finished=True,
        finish_reason="abort",
        num_prompt_tokens=stream.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens if last else 0,
    )
