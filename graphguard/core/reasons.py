"""The closed set of reasons a call runs eagerly instead of replaying a graph.

Every call either replays an admitted graph or falls back with exactly one of these. The values
double as Prometheus label values, so the set must stay closed and small.
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
    THRASHING = "thrashing"  # evicted and recaptured too often; backing off
    NOT_PREWARMED = "not_prewarmed"  # mode="prewarmed" and this key was not warmed up
    CLOSED = "closed"  # the runner was closed


ALL_REASONS: tuple[FallbackReason, ...] = tuple(FallbackReason)
