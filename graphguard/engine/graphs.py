"""The engine's graphs as one component, built from explicit inputs.

`build_graphs` runs the capability check (deny by default: the first failing condition is
reported from a closed set) and returns either an `EngineGraphs` or the reason graphs are off.
`EngineGraphs` owns the decode runner, the prefill runners (whole graphs of short prefills run
as rows, segmented graphs of the rest: prefill_graphs.py) and their shared metrics,
and gives the model runner the two step functions it calls. Nothing here patches the engine:
the engine hands these functions to its ModelRunner when it builds it, and calls
invalidate() / close() / stats() at reload, shutdown and for /v1/graphs.

With `GraphConfig.background_capture` a key that traffic earns is captured between steps: the
engine calls before_step() once per step, on its step thread, and that runs bounded units of
work of the decode or the prefill capture in flight (taking turns, one unit at a time) as the
pacing allows (graphguard/engine/capture_pacing.py: none while requests wait for their first
token, within a bound; else up to a time slice), so no capture overlaps a step (the cuBLAS
workspace clears of a capture must not race a step's matmuls). Warm-up and prewarm at start
still capture before the first request.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch

from graphguard.core.backends import Backend, CudaBackend
from graphguard.core.keys import pad_ladder
from graphguard.core.metrics import GraphMetrics
from graphguard.core.switch import kill_switch_on
from graphguard.engine.capture_pacing import CapturePacer
from graphguard.engine.config import GraphConfig
from graphguard.engine.decode_graphs import DecodeGraphs
from graphguard.engine.forward import MIN_PREFILL_TOKENS, ROW_PREFILL_TOKENS, EagerForward
from graphguard.engine.parallel.ranks import RankRole
from graphguard.engine.prefill_graphs import PrefillGraphs

log = logging.getLogger("graphguard")
MIN_COMPUTE_CAPABILITY = (7, 0)


class GraphCapability(enum.StrEnum):
    """Whether the engine's graphs may run, and if not, the first condition that failed."""

    ENABLED = "enabled"
    ENFORCE_EAGER = "enforce_eager"
    KILL_SWITCH = "kill_switch"
    NO_CUDA = "no_cuda"
    UNSUPPORTED_ARCH = "unsupported_arch"
    KV_IDENTITY_MISMATCH = "kv_identity_mismatch"
    DEVICE_MISMATCH = "device_mismatch"


def check_capability(
    config: GraphConfig, forward: EagerForward, scheduler_kv: object, device: torch.device
) -> GraphCapability:
    """The capability proof: every condition, in order; the first that fails is returned."""
    if config.enforce_eager:
        return GraphCapability.ENFORCE_EAGER
    if kill_switch_on():
        return GraphCapability.KILL_SWITCH
    if config.backend != "sim":
        if device.type != "cuda" or not torch.cuda.is_available():
            return GraphCapability.NO_CUDA
        if torch.cuda.get_device_capability(device) < MIN_COMPUTE_CAPABILITY:
            return GraphCapability.UNSUPPORTED_ARCH
    # The KV view the scheduler allocates from and the one attention writes must be one object.
    if forward.kv is not scheduler_kv:
        return GraphCapability.KV_IDENTITY_MISMATCH
    kv = forward.kv
    tensors = [*kv.k_cache, *kv.v_cache, *forward.model.parameters()]
    if any(t.device != device for t in tensors):
        return GraphCapability.DEVICE_MISMATCH
    return GraphCapability.ENABLED


def _backend(config: GraphConfig, device: torch.device) -> str | Backend:
    """A CUDA backend of the engine's own, warming up `config.capture_warmups` times before a
    capture; "sim" (and "auto" without CUDA) as named."""
    if config.backend == "sim" or (config.backend == "auto" and not torch.cuda.is_available()):
        return config.backend
    return CudaBackend(device, num_warmup=config.capture_warmups)


class EngineGraphs:
    """The decode graphs, the segmented prefill graphs (unless off) and their metrics."""

    def __init__(
        self,
        config: GraphConfig,
        forward: EagerForward,
        device: torch.device,
        model_identity: dict[str, Any],
        role: RankRole | None = None,
    ) -> None:
        self.config = config
        self.role = role
        self.enabled_reason = GraphCapability.ENABLED.value
        self.metrics = GraphMetrics()  # one registry for the decode and prefill graphs
        self.registry = self.metrics.registry
        self.decode = DecodeGraphs(
            forward,
            buckets=config.batch_buckets,
            max_bytes=config.max_bytes,
            backend=_backend(config, device),
            device=device,
            metrics=self.metrics,
            model_identity=model_identity,
            admission=config.admission,
            verify=config.verify,
            reverify_every=config.reverify_every,
            background=config.background_capture,
            max_pad_factor=config.decode_pad_factor,
            role=role,
        )
        self.prefill: PrefillGraphs | None = None
        # NOTE: a tensor-parallel rank prefills eagerly: only decode graphs follow rank 0's
        # decisions so far (docs/parallel.md).
        if config.prefill and role is None:
            self.prefill = PrefillGraphs(
                forward,
                max_bytes=config.max_bytes,
                backend=_backend(config, device),
                device=device,
                metrics=self.metrics,
                admission=config.prefill_admission,
                verify=config.verify,
                background=config.background_capture,
                max_pad_factor=config.row_pad_factor,
            )
        self._eager_prefill = forward.prefill
        self._prefill_turn = False  # whose unit runs when both capture between steps
        self.pacer = CapturePacer(config.capture_pacing, self.advance_capture)

    @property
    def decode_fn(self) -> DecodeGraphs:
        return self.decode

    def decode_bucket(self, num_rows: int) -> int:
        """The rows a decode batch of `num_rows` is padded to: its batch bucket (itself when
        it is larger than every bucket, and then it runs eagerly)."""
        return self.decode.buckets.bucket_for(num_rows) or num_rows

    @property
    def prefill_fn(self) -> Any:
        """The prefill graphs (rows and segmented), or the eager prefill when they are off."""
        return self.prefill if self.prefill is not None else self._eager_prefill

    def start(
        self, warmup_keys: tuple[list[int], list[int]], prefill_tokens: Sequence[int] = ()
    ) -> None:
        """What the config asks for before the first request: prewarm from a manifest, then
        capture every decode (batch, width) key of `warmup_keys` and the prefill graphs of
        `prefill_tokens` (prefill_graphs.py `PrefillGraphs.warmup`) within the budgets."""
        if self.config.manifest:
            _prewarm_from(self.decode, self.config.manifest)
        if not self.config.warmup:
            if self.config.price_captures:
                self._price_captures(warmup_keys, prefill_tokens)
            return
        batch_sizes, widths = warmup_keys
        report = self.decode.warmup(batch_sizes, widths)
        log.info(
            "graphguard decode warmup: %d of %d keys captured in %.1f s",
            len(report.captured),
            len(batch_sizes) * len(widths),
            report.seconds,
        )
        if self.prefill is not None and prefill_tokens:
            report = self.prefill.warmup(prefill_tokens, widths)
            log.info(
                "graphguard prefill warmup: %d graphs captured for %d token buckets in %.1f s",
                len(report.captured),
                len(prefill_tokens),
                report.seconds,
            )

    def _price_captures(
        self, warmup_keys: tuple[list[int], list[int]], prefill_tokens: Sequence[int]
    ) -> None:
        """A lazy start captures a ladder of keys of each runner at every table width of
        `warmup_keys`: what they cost prices the captures that traffic earns (the admission's
        payback rule), before a request pays for the lesson, and under the pad-up rule
        (`decode_pad_factor`, `row_pad_factor`) they answer every decode batch and every
        prefill as rows from the first step (keys.py `pad_ladder`: 64 and 2 rows of decode with
        the default 64 sequences, 2,048, 256 and 32 tokens of rows, at the default factors,
        each at the widths it runs at). A short step is launch-bound, so a padded replay costs
        about what its own graph would. Without rows, the smallest prefill group. Not under
        tensor parallelism, where rank 0 learns the price from the first capture earned."""
        if self.role is not None:
            return
        batch_sizes, widths = warmup_keys  # warmup_shapes: never empty
        reports = []
        if not self.decode.runner.policy.knows_a_price:  # a manifest's graphs priced it
            ladder = pad_ladder(batch_sizes, self.config.decode_pad_factor)
            reports.append(self.decode.warmup(ladder, widths, progress=False))
        if self.prefill is not None and not self.prefill.knows_a_price:
            tokens = [MIN_PREFILL_TOKENS]
            if self.prefill.rows is not None and prefill_tokens:
                tokens = pad_ladder(prefill_tokens, self.config.row_pad_factor)
            reports.append(self.prefill.warmup(tokens, widths, progress=False))
        log.info(
            "graphguard lazy start: %d graphs captured in %.2f s",
            sum(len(report.captured) for report in reports),
            sum(report.seconds for report in reports),
        )

    def before_step(self, has_pending_prefills: bool) -> int:
        """Run what the coming step may of the captures in flight (see module docstring);
        how many units ran. The kill switch is never put off: the next advance cancels
        them."""
        if not self.has_capture_in_flight:
            return 0
        return self.pacer.before_step(has_pending_prefills and not kill_switch_on())

    def advance_capture(self) -> bool:
        """One unit of work of a capture in flight between steps (decode and prefill take
        turns when both have one). Returns True while a capture remains in flight."""
        graphs = self._graphs()
        if self._prefill_turn:
            graphs.reverse()
        self._prefill_turn = not self._prefill_turn
        for graph in graphs:
            if graph.capture_in_flight is not None:
                graph.advance_capture()
                break
        return self.has_capture_in_flight

    @property
    def has_capture_in_flight(self) -> bool:
        return any(graph.capture_in_flight is not None for graph in self._graphs())

    def _graphs(self) -> list[DecodeGraphs | PrefillGraphs]:
        return [self.decode] if self.prefill is None else [self.decode, self.prefill]

    def invalidate(self) -> None:
        """Retire every graph (new weights) and cancel the captures in flight: called before
        the weights change."""
        self.decode.invalidate()
        if self.prefill is not None:
            self.prefill.invalidate()

    def close(self) -> None:
        self.decode.close()
        if self.prefill is not None:
            self.prefill.close()

    def stats(self) -> dict[str, Any]:
        """The decode graphs' stats, with the prefill graphs' under "prefill" (or None)."""
        stats = self.decode.stats()
        stats["enabled"] = True
        stats["reason"] = self.enabled_reason
        stats["capture_steps_deferred"] = self.pacer.num_deferred_total  # for pending prefills
        stats["prefill"] = self.prefill.stats() if self.prefill is not None else None
        return stats


def build_graphs(
    config: GraphConfig,
    forward: EagerForward,
    *,
    scheduler_kv: object,
    device: torch.device,
    model_identity: dict[str, Any],
    warmup_keys: tuple[list[int], list[int]],
    prefill_tokens: Sequence[int] = (),
    role: RankRole | None = None,
) -> EngineGraphs | GraphCapability:
    """The engine's graphs, started, when the capability check passes; else why not."""
    capability = check_capability(config, forward, scheduler_kv, device)
    if capability is not GraphCapability.ENABLED:
        log.info("graphguard decode graphs off: %s", capability.value)
        if config.manifest:
            log.info("graphguard manifest %s unused: graphs off", config.manifest)
        return capability
    graphs = EngineGraphs(config, forward, device, model_identity, role)
    log.info(
        "graphguard decode graphs on: backend=%s buckets=%s budget=%d bytes",
        config.backend,
        list(config.batch_buckets),
        config.max_bytes,
    )
    if graphs.prefill is not None:
        whole = graphs.prefill.rows is not None
        log.info(
            "graphguard prefill graphs on: %s%d segments",
            f"whole graphs up to {ROW_PREFILL_TOKENS} tokens, above them " if whole else "",
            graphs.prefill.runner.num_segments,
        )
    else:
        log.info("graphguard prefill graphs off: prefill=False")
    graphs.start(warmup_keys, prefill_tokens)
    return graphs


def _prewarm_from(decode: DecodeGraphs, manifest: str) -> None:
    # NOTE: a start never fails for a manifest: refusals and errors leave graphs lazy.
    try:
        decode.prewarm(manifest)
    except Exception:  # noqa: BLE001
        log.exception("graphguard prewarm from %s failed; graphs will be captured lazily", manifest)
