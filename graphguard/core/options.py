"""How a runner captures and serves its graphs: every option but the budget (`max_bytes`),
verification (VerifyConfig) and admission (AdmissionConfig)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class CaptureConfig:
    """Options of a runner's captures and replays.

    Args:
        background: capture between calls instead of in the call that earns a key: that call
            and the key's next ones run eagerly (capture_in_progress) while whoever drives the
            runner calls advance_capture() between calls, one bounded unit of work each time.
        examples: inputs of a key for a capture between calls (`examples(key)`); a GraphRunner
            with buckets defaults to every row padding.
        retain: objects each graph keeps alive while it can replay (weights, KV storage).
        device: the CUDA device graphs are captured on (default: the current one).
        copy_outputs: return copies (True) or views of the static outputs, valid until the
            next call of this runner (False).
        stage_host_inputs: accept CPU tensors for a CUDA graph, copied through pinned buffers.
        max_pad_factor: a call whose bucket has no graph yet (its capture not earned or in
            flight) replays the smallest admitted larger bucket of the same call, up to this
            many times its bucket's rows, instead of answering eagerly: its real rows are
            copied in and the rest padded, as for its own bucket. 1 (default): never. The call
            counts as a replay (`covered` in stats); the key goes on earning its own graph by
            the admission rules, but payback counts no eager time for it meanwhile.
        strict: re-raise capture failures and parity mismatches instead of falling back.
        enabled: False runs every call eagerly (reason `disabled`).
        max_state_bytes: the most a capture may save of what the step writes in place (its
            state, graphguard/core/state.py) to put it back; more: `state_too_large`.
        state: the tensors the step may write in place, when declared; a write outside them
            refuses capture (`undeclared_state`). Default: found by watching the step.
        unwatched: objects the step reaches whose Python-side values are not its state (a
            clock, a stats counter): a capture never walks them (graphguard/core/pystate.py),
            so their changes neither refuse a capture nor are put back.
    """

    background: bool = False
    examples: Callable[..., Any] | None = None
    retain: Sequence[Any] = ()
    device: Any = None
    copy_outputs: bool = True
    stage_host_inputs: bool = False
    max_pad_factor: int = 1
    strict: bool = False
    enabled: bool = True
    max_state_bytes: int = 1 << 30
    state: Sequence[Any] | None = None
    unwatched: Sequence[Any] = ()

    def owners_apart(self) -> tuple[list[Any], CaptureConfig]:
        """The owners to retain, and these options without them.

        NOTE: a runner keeps its owners in one place (what every new graph retains), so that
        once the caller lets go of them, the admitted graphs are what keeps them alive."""
        return list(self.retain), replace(self, retain=())

    def __post_init__(self) -> None:
        if self.max_pad_factor < 1:
            raise ValueError(f"max_pad_factor must be >= 1, got {self.max_pad_factor}")
        object.__setattr__(self, "retain", tuple(self.retain))
        object.__setattr__(self, "unwatched", tuple(self.unwatched))
        if self.state is not None:
            object.__setattr__(self, "state", tuple(self.state))
        if self.max_state_bytes < 0:
            raise ValueError(f"max_state_bytes must be >= 0, got {self.max_state_bytes}")
