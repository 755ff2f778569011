"""The messages between the server process and the engine process (engine_process.py).

Both ends speak over one duplex `multiprocessing` pipe, a message a pickled object. The server
sends commands (`AddRequests`, `AbortRequests`, `Query`); the engine answers each `AddRequests`
with an `Admitted` and each `Query` with a `Reply`, and after every step sends one
`StepOutputs` carrying every request's new tokens, finish events and the engine's stats: one
message a step, never one a token. `EngineReady` opens the conversation, `EngineStopped` may
close it.

A request's output travels as an `OutputRow` tuple, not a RequestOutput: its cumulative text
is left out (the server adds the deltas up), so a step's message does not grow with the
length of its requests' answers.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, NamedTuple

from torch import Tensor

from graphguard.engine.config import ModelConfig
from graphguard.engine.models.vision import VisionConfig
from graphguard.engine.outputs import RequestOutput
from graphguard.engine.tokens.sampling import SamplingParams, TokenLogprob
from graphguard.engine.tokens.tokenizer import Tokenizer


class QueryKind(Enum):
    """What a `Query` asks the engine process for (answered off its step loop)."""

    GRAPHS_REPORT = "graphs_report"  # LLMEngine.graphs_report()
    GRAPH_METRICS = "graph_metrics"  # the graph registry's metric families, or None


@dataclass(frozen=True)
class EngineRequest:
    """A request for the engine: its id (unique among those in flight), prompt and sampling."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[Tensor] | None = None  # pixel tensors, one per image placeholder run
    # Another choice of the request named here, added before it in the same call: it shares
    # that one's prefill (LLMEngine.add_request's fork_of).
    fork_of: str | None = None


@dataclass(frozen=True)
class VisionSpec:
    """What the server needs of the engine's vision encoder: settings and token ids only."""

    config: VisionConfig
    text_hidden_size: int
    image_token_id: int


@dataclass(frozen=True)
class EngineInfo:
    """What the server reads of its engine once, at start."""

    pid: int  # the engine process's (the server's own in in-process mode)
    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int
    block_size: int
    stats: dict[str, Any]
    vision: VisionSpec | None
    description: list[str]  # startup lines: device, dtype, kernels, graphs
    has_graph_metrics: bool  # graphs are on: /metrics shows their registry
    model_folder: str | None = None  # where the weights came from (its generation config)


# ---- server -> engine ------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequests:
    """Admit every request or none; answered by `Admitted(ticket)`."""

    ticket: int
    requests: list[EngineRequest]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str] | None  # None: every request


@dataclass(frozen=True)
class Query:
    ticket: int
    kind: QueryKind


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, release the engine, send `EngineStopped` and exit."""


Command = AddRequests | AbortRequests | Query | Shutdown


# ---- engine -> server ------------------------------------------------------------------------


class OutputRow(NamedTuple):
    """A RequestOutput without its cumulative text."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    error: str | None
    stop_reason: int | str | None


def output_row(output: RequestOutput) -> OutputRow:
    # NOTE: tuple.__new__ skips the NamedTuple's __new__, a Python function: 14 against 21 us
    # for a step of 64 rows, on the engine's step loop.
    return _new_tuple(
        OutputRow,
        (
            output.request_id,
            output.new_token_ids,
            output.delta_text,
            output.finished,
            output.finish_reason,
            output.num_prompt_tokens,
            output.num_output_tokens,
            output.logprobs,
            output.prompt_logprobs,
            output.error,
            output.stop_reason,
        ),
    )


_new_tuple = tuple.__new__


def request_output(row: OutputRow, text_before: str) -> RequestOutput:
    """The RequestOutput `row` stands for, after `text_before` (its request's text so far)."""
    return RequestOutput(
        request_id=row.request_id,
        new_token_ids=row.new_token_ids,
        delta_text=row.delta_text,
        text=text_before + row.delta_text,
        finished=row.finished,
        finish_reason=row.finish_reason,
        num_prompt_tokens=row.num_prompt_tokens,
        num_output_tokens=row.num_output_tokens,
        logprobs=row.logprobs,
        prompt_logprobs=row.prompt_logprobs,
        error=row.error,
        stop_reason=row.stop_reason,
    )


@dataclass(frozen=True)
class EngineReady:
    info: EngineInfo


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not start (`is_config_error`: a setting it cannot honour)."""

    message: str
    is_config_error: bool


@dataclass(frozen=True)
class Admitted:
    """The answer to `AddRequests(ticket)`: error None when all were admitted."""

    ticket: int
    error: str | None = None
    is_invalid: bool = False  # the engine refused a request (a ValueError): a 400, not a 500
    param: str | None = None  # the parameter the refusal names, when it names one


@dataclass(frozen=True)
class StepOutputs:
    """One step's outputs (or the abort outputs of commands), with the stats after it.
    `failed` lists requests a step error ended, with `error` its message."""

    rows: list[OutputRow]
    stats: dict[str, Any]
    is_step: bool  # False: sent after commands, no step ran
    failed: list[str] | None = None
    error: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: the rows cross the pipe as plain tuples. A NamedTuple pickles through a Python
        # call per row and unpickles through another: a step of 64 rows took 58 us to encode
        # in the engine process and 32 to decode in the server, now 19 and 25.
        rest = (getattr(self, name) for name in _STEP_FIELDS[1:])
        return _step_outputs, ([tuple(row) for row in self.rows], *rest)


_STEP_FIELDS = tuple(field.name for field in fields(StepOutputs))
assert _STEP_FIELDS[0] == "rows"  # __reduce__ sends every field, the rows first


def _step_outputs(rows: list[tuple[Any, ...]], *rest: Any) -> StepOutputs:
    return StepOutputs([_new_tuple(OutputRow, row) for row in rows], *rest)


@dataclass(frozen=True)
class Reply:
    ticket: int
    value: Any
    error: str | None = None


@dataclass(frozen=True)
class EngineStopped:
    """The engine process has released the engine and is about to exit."""


EngineMessage = EngineReady | EngineFailed | Admitted | StepOutputs | Reply | EngineStopped


def encode(message: Command | EngineMessage) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """A message `encode` made (the pipe's other end is this program's own process)."""
    return pickle.loads(data)  # noqa: S301 - only our own child process writes to the pipe
