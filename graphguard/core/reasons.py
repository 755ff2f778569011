"""The closed sets of the runtime's outcomes: why a call runs eagerly instead of replaying a
graph, how a capture ended, why a graph was evicted, and how a prewarm went.

Every call either replays an admitted graph or falls back with exactly one FallbackReason. The
values double as Prometheus label values (and as the strings of reports and manifests), so each
set must stay closed and small.
"""

from __future__ import annotations

import enum


class FallbackReason(enum.StrEnum):
    """Why a call ran eagerly. Exactly one per fallback call."""

    DISABLED = "disabled"  # the runner was built or switched off (enabled=False)
    KILL_SWITCH = "kill_switch"  # GRAPHGUARD_DISABLE=1 in the environment, read on every call
    NO_CUDA = "no_cuda"  # backend "auto" on a machine without CUDA
    DEVICE_MISMATCH = "device_mismatch"  # an input lives on another device than the runner's
    UNBUCKETED_SHAPE = "unbucketed_shape"  # above the largest bucket, or inputs disagree on rows
    UNSUPPORTED_INPUT = "unsupported_input"  # an argument the runner cannot key (not hashable)
    QUARANTINED = "quarantined"  # the key failed before and is backing off
    CAPTURE_FAILED = "capture_failed"  # this call's capture raised; the result is eager
    PARITY_MISMATCH = "parity_mismatch"  # the graph's output differed from eager
    OVER_BUDGET = "over_budget"  # the graph alone does not fit the byte budget
    ADMISSION_DEFERRED = "admission_deferred"  # not seen often enough / capture work budget
    CAPTURE_IN_PROGRESS = "capture_in_progress"  # its graph is being captured between calls
    THRASHING = "thrashing"  # evicted and recaptured too often; backing off
    NOT_PREWARMED = "not_prewarmed"  # mode="prewarmed" and this key was not warmed up
    CLOSED = "closed"  # the runner was closed
    # the step writes state a capture cannot put back (graphguard/core/state.py); for good:
    UNOWNABLE_STATE = "unownable_state"  # a host tensor, or the step's own inputs
    UNDECLARED_STATE = "undeclared_state"  # a write outside the state the caller declared
    STATE_TOO_LARGE = "state_too_large"  # saving what it writes exceeds max_state_bytes
    PYTHON_STATE = "python_state"  # it keeps tensors it created (state in Python objects)


ALL_REASONS: tuple[FallbackReason, ...] = tuple(FallbackReason)


class CaptureOutcome(enum.StrEnum):
    """How a capture ended (the label values of `graphguard_captures_total`)."""

    ADMITTED = "admitted"  # verified and admitted to the cache
    FAILED = "failed"  # the capture (or a warm-up) raised; the key is quarantined
    PARITY_MISMATCH = "parity_mismatch"  # the first replay differed from eager; quarantined
    OVER_BUDGET = "over_budget"  # the graph alone does not fit the budget
    CANCELLED = "cancelled"  # a capture between calls, stopped by invalidate, close or the switch
    STATE_REFUSED = "state_refused"  # the step's state cannot be put back; the key stays eager


class EvictionCause(enum.StrEnum):
    """Why an admitted graph was retired (the label values of `graphguard_evictions_total`)."""

    BUDGET = "budget"  # room for another graph
    REVERIFY = "reverify"  # a periodic re-verification found it drifting
    REPLAY_FAILED = "replay_failed"  # a replay raised (a hole that broke its contract)
    INVALIDATE = "invalidate"  # every graph retired: new weights, say
    CLOSE = "close"  # the runner closed


class PrewarmOutcome(enum.StrEnum):
    """What became of a manifest key (the label values of `graphguard_prewarm_keys_total`)."""

    PREWARMED = "prewarmed"  # captured (or already resident) and admitted
    SKIPPED = "skipped"  # not captured; the report says why


class PrewarmRefusal(enum.StrEnum):
    """Why a whole manifest was refused (the label values of
    `graphguard_prewarm_refusals_total`); nothing is captured from a refused manifest."""

    UNREADABLE = "unreadable"  # missing, not JSON, not a graphguard manifest, malformed
    VERSION = "version"  # a graphguard manifest of another format version
    TORCH = "torch"  # written by another torch version
    DEVICE = "device"  # captured on another device name or backend (or none here)
    MODEL = "model"  # the engine's model identity differs


class PrewarmSkip(enum.StrEnum):
    """Why one key of a manifest that was used is skipped before warm-up (a warm-up skip
    names a FallbackReason instead)."""

    UNREADABLE_KEY = "unreadable_key"  # a key that cannot be rebuilt here
    OVER_BUDGET = "over_budget"  # its example inputs alone exceed the byte budget
    KEY_MISMATCH = "key_mismatch"  # this runner's buckets map its inputs to another key
