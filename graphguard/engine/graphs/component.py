"""The engine's graphs as one component, built from explicit inputs.

`build_graphs` runs the capability check (graphs/capability.py) and returns either an
`EngineGraphs` or the reason graphs are off. `EngineGraphs` holds the runners a step
replays (graphs/runners.py: `decode`, `prefill_rows`, `prefill`, `prefill_whole`) as plain
fields: the engine hands the component to its ModelRunner, which calls a runner or the eager
forward in one visible branch; the engine calls start(), before_step(), invalidate(), close()
and stats() at start, before each step, at reload, at shutdown and for /v1/graphs.

With `GraphConfig.background_capture` a key that traffic earns is captured between steps: the
engine calls before_step() once per step, on its step thread, and that runs bounded units of
work of the decode or the prefill capture in flight (taking turns, one unit at a time) as the
pacing allows (graphs/pacing.py: none while requests wait for their first token, within a
bound; else up to a time slice), so no capture overlaps a step (the cuBLAS workspace clears of
a capture must not race a step's matmuls). Warm-up and prewarm at start still capture before
the first request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from graphguard.core.capture import WarmupReport
from graphguard.core.export import export_manifest
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.keys import pad_ladder
from graphguard.core.metrics import GraphMetrics
from graphguard.core.prewarm import prewarm
from graphguard.core.reasons import EvictionCause
from graphguard.core.switch import kill_switch_on
from graphguard.engine.config import GraphConfig
from graphguard.engine.graphs.capability import GraphCapability, check_capability, engine_backend
from graphguard.engine.graphs.pacing import CapturePacer
from graphguard.engine.graphs.runners import (
    decode_runner,
    rows_runner,
    segmented_runner,
    whole_prefill_runner,
)
from graphguard.engine.graphs.warmup import (
    prefill_knows_a_price,
    warm_decode,
    warm_prefill,
    warm_whole_prefill,
)
from graphguard.engine.models.forward import EagerForward
from graphguard.engine.parallel.ranks import RankRole
from graphguard.engine.shapes import (
    MIN_PREFILL_TOKENS,
    MIN_WIDTH_BLOCKS,
    ROW_PREFILL_TOKENS,
    continued_prefill_group,
    prefill_seq_bucket,
    wave_seq_buckets,
)
from graphguard.segmented import SegmentedRunner

log = logging.getLogger("graphguard")


class EngineGraphs:
    """The decode runner, the prefill runners (unless off) and their shared metrics."""

    def __init__(
        self,
        config: GraphConfig,
        forward: EagerForward,
        device: torch.device,
        model_identity: dict[str, Any],
        role: RankRole | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        self.config = config
        self.forward = forward
        self.role = role
        # the most sequences a step holds (None: the largest decode batch bucket warmed)
        self.max_num_seqs = max_num_seqs
        # What a manifest must match to prewarm these graphs: model, shapes, dtype, KV layout.
        self.model_identity = model_identity
        self.enabled_reason = GraphCapability.ENABLED.value
        self.metrics = GraphMetrics()  # one registry for the decode and prefill graphs
        self.registry = self.metrics.registry
        backend = engine_backend(config, device)
        self.decode: GraphRunner = decode_runner(forward, config, backend, self.metrics, role)
        # NOTE: a tensor-parallel rank prefills eagerly: only decode graphs follow rank 0's
        # decisions so far (docs/parallel.md).
        has_prefill = config.prefill and role is None
        self.prefill_rows: GraphRunner | None = (
            rows_runner(forward, config, backend, self.metrics) if has_prefill else None
        )
        self.prefill: SegmentedRunner | None = (
            segmented_runner(forward, config, backend, self.metrics) if has_prefill else None
        )
        # whole graphs of packed prefills, earned by traffic; until then the segments answer
        self.prefill_whole: SegmentedRunner | None = (
            whole_prefill_runner(forward, config, backend, self.metrics, self.prefill)
            if self.prefill is not None
            else None
        )
        self._prefill_turn = False  # whose unit runs when both capture between steps
        self.pacer = CapturePacer(config.capture_pacing, self.advance_capture)

    def decode_rows(self, num_rows: int) -> int:
        """The rows a decode batch of `num_rows` is padded to: its batch bucket (itself when
        it is larger than every bucket, and then it runs eagerly)."""
        return self.decode.buckets.bucket_for(num_rows) or num_rows  # type: ignore[union-attr]

    # -- captures at start -------------------------------------------------------------------
    def start(
        self, warmup_keys: tuple[list[int], list[int]], prefill_tokens: Sequence[int] = ()
    ) -> None:
        """What the config asks for before the first request: prewarm from a manifest, then
        capture every decode (batch, width) key of `warmup_keys` and the prefill graphs of
        `prefill_tokens` within the budgets."""
        if self.config.manifest:
            self._prewarm_from(self.config.manifest)
        if not self.config.warmup:
            if self.config.price_captures:
                log.info("graphguard: capturing a ladder of graphs to price captures")
                self._price_captures(warmup_keys, prefill_tokens)
            return
        batch_sizes, widths = warmup_keys
        log.info("graphguard: capturing %d decode graphs", len(batch_sizes) * len(widths))
        report = self.warm_decode(batch_sizes, widths)
        log.info(
            "graphguard decode warmup: %d of %d keys captured in %.1f s",
            len(report.captured), len(batch_sizes) * len(widths), report.seconds,
        )  # fmt: skip
        if self.prefill is not None and prefill_tokens:
            groups = self.continued_prefill_groups(prefill_tokens, widths)
            report = self.warm_prefill(prefill_tokens, widths, groups=groups)
            report.add(self.warm_whole(groups, widths, self._max_rows(batch_sizes)))
            log.info(
                "graphguard prefill warmup: %d graphs captured for %d token buckets in %.1f s",
                len(report.captured), len(prefill_tokens), report.seconds,
            )  # fmt: skip

    def warm_decode(
        self, batch_sizes: Sequence[int], widths: Sequence[int], progress: bool = True
    ) -> WarmupReport:
        """Capture decode (batch, width) keys now (graphs/warmup.py)."""
        return warm_decode(self.decode, batch_sizes, widths, progress)

    def warm_prefill(
        self,
        token_counts: Sequence[int],
        widths: Sequence[int] = (MIN_WIDTH_BLOCKS,),
        progress: bool = True,
        groups: Sequence[int] = (),
    ) -> WarmupReport:
        """Capture the prefill graphs of `token_counts` tokens now, and the groups of segments
        of `groups` tokens (graphs/warmup.py)."""
        assert self.prefill is not None, "prefill graphs are off"
        rows, prefill = self.prefill_rows, self.prefill
        return warm_prefill(self.forward, rows, prefill, token_counts, widths, progress, groups)

    def warm_whole(
        self, groups: Sequence[int], widths: Sequence[int], max_rows: int, progress: bool = True
    ) -> WarmupReport:
        """Where packed prefills have whole graphs, capture those of the continued groups
        (`groups`) at the widest of `widths`, for every sequence bucket a wave of up to
        `max_rows` continued chunks lands on (shapes.py `wave_seq_buckets`), so that the first
        waves of questions after documents as long as the server takes replay one graph each;
        without a continued group, the smallest key (a short prompt and its padding), so that
        the whole runner knows a capture's price (the payback rule). Elsewhere nothing."""
        whole = self.prefill_whole
        if whole is None:
            return WarmupReport()
        if not groups:
            return warm_whole_prefill(
                self.forward, whole, MIN_PREFILL_TOKENS, MIN_WIDTH_BLOCKS,
                [prefill_seq_bucket(1)], progress,
            )  # fmt: skip
        report, buckets = WarmupReport(), wave_seq_buckets(max_rows)
        for tokens in groups:
            report.add(
                warm_whole_prefill(self.forward, whole, tokens, max(widths), buckets, progress)
            )
        return report

    def _max_rows(self, batch_sizes: Sequence[int]) -> int:
        return self.max_num_seqs or max(batch_sizes)

    def continued_prefill_groups(
        self, prefill_tokens: Sequence[int], widths: Sequence[int]
    ) -> tuple[int, ...]:
        """The group of segments a start captures for continued prefills too large to run as
        rows (shapes.py `continued_prefill_group`), or none."""
        kernels, block_size = self.forward.model.kernels, self.forward.kv.block_size
        group = continued_prefill_group(kernels, block_size, widths, max(prefill_tokens, default=0))
        return () if group is None else (group,)

    def _price_captures(
        self, warmup_keys: tuple[list[int], list[int]], prefill_tokens: Sequence[int]
    ) -> None:
        """A lazy start captures a ladder of keys of each runner at every table width of
        `warmup_keys`: what they cost prices the captures that traffic earns (the admission's
        payback rule), before a request pays for the lesson, and under the pad-up rule
        (`decode_pad_factor`, `row_pad_factor`) they answer every decode batch and every
        prefill as rows from the first step (keys.py `pad_ladder`: with the defaults, 64 and 2
        rows of decode, and 2,048, 256 and 32 tokens of rows, each at the widths it runs at).
        A short step is launch-bound, so a padded replay costs about what its own graph would.
        Where contexts are long enough that a wave of short chunks over them cannot run as
        rows, the group of segments of 512 packed tokens too (`continued_prefill_groups`).
        Without rows, the smallest prefill group. Not under tensor parallelism, where rank 0
        learns the price from the first capture earned."""
        if self.role is not None:
            return
        batch_sizes, widths = warmup_keys  # warmup_shapes: never empty
        reports = []
        if not self.decode.policy.knows_a_price:  # a manifest's graphs priced it
            ladder = pad_ladder(batch_sizes, self.config.decode_pad_factor)
            reports.append(self.warm_decode(ladder, widths, progress=False))
        prefill = self.prefill
        if prefill is not None and not prefill_knows_a_price(
            self.forward, self.prefill_rows, prefill
        ):
            tokens = [MIN_PREFILL_TOKENS]
            groups: tuple[int, ...] = ()
            if self.prefill_rows is not None and prefill_tokens:
                tokens = pad_ladder(prefill_tokens, self.config.row_pad_factor)
                groups = self.continued_prefill_groups(prefill_tokens, widths)
            reports.append(self.warm_prefill(tokens, widths, progress=False, groups=groups))
            rows = self._max_rows(batch_sizes)
            reports.append(self.warm_whole(groups, widths, rows, progress=False))
        log.info(
            "graphguard lazy start: %d graphs captured in %.2f s",
            sum(len(report.captured) for report in reports),
            sum(report.seconds for report in reports),
        )

    def export(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Write the decode graphs' manifest, with the model identity, to `path`."""
        return export_manifest(self.decode, path, model=self.model_identity)

    def prewarm(self, manifest: Any, progress: bool = True) -> WarmupReport:
        """Capture the manifest's decode keys; refused (lazy start) for another model."""
        return prewarm(self.decode, manifest, progress=progress, model=self.model_identity)

    def _prewarm_from(self, manifest: str) -> None:
        # NOTE: a start never fails for a manifest: refusals and errors leave graphs lazy.
        try:
            self.prewarm(manifest)
        except Exception:  # noqa: BLE001
            log.exception("graphguard prewarm from %s failed; graphs stay lazy", manifest)

    # -- captures between steps --------------------------------------------------------------
    def before_step(self, has_pending_prefills: bool) -> int:
        """Run what the coming step may of the captures in flight (see module docstring);
        how many units ran. The kill switch is never put off: the next advance cancels
        them."""
        if not self.has_capture_in_flight:
            return 0
        return self.pacer.before_step(has_pending_prefills and not kill_switch_on())

    def advance_capture(self) -> bool:
        """One unit of work of a capture in flight between steps (decode and prefill take
        turns when both have one; a rows key's, then a whole graph's, before a group of
        segments'). Returns True while a capture remains in flight."""
        runners = self.runners()
        if self._prefill_turn:
            runners = runners[1:] + runners[:1]
        self._prefill_turn = not self._prefill_turn
        for runner in runners:
            if runner.capture_in_flight is not None:
                runner.advance_capture()
                break
        return self.has_capture_in_flight

    @property
    def has_capture_in_flight(self) -> bool:
        return any(runner.capture_in_flight is not None for runner in self.runners())

    def runners(self) -> list[GraphRunner | SegmentedRunner]:
        """Every runner: decode first, then those of prefill (the whole graphs' before the
        segments', which answer their calls meanwhile: the capture that advances first when
        both are in flight is the one that will be used)."""
        prefill = [self.prefill_rows, self.prefill_whole, self.prefill]
        return [self.decode, *(runner for runner in prefill if runner is not None)]

    # -- lifecycle ---------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Retire every graph (new weights) and cancel the captures in flight: called before
        the weights change."""
        counts = [runner.invalidate(EvictionCause.INVALIDATE) for runner in self.runners()]
        log.info("graphguard graphs invalidated: %d retired", sum(counts))

    def close(self) -> None:
        for runner in self.runners():
            runner.close()

    def stats(self) -> dict[str, Any]:
        """The decode graphs' stats, with the prefill graphs' under "prefill" (or None) and
        the rows graphs' under "prefill"/"rows" (or None)."""
        stats = self.decode.stats()
        stats["kv_bytes"] = self.forward.kv.kv_bytes
        stats["graphs"] = [asdict(info) for info in self.decode.entries()]
        stats["enabled"] = True
        stats["reason"] = self.enabled_reason
        stats["capture_steps_deferred"] = self.pacer.num_deferred_total  # for pending prefills
        stats["prefill"] = None
        if self.prefill is not None:
            stats["prefill"] = _segmented_stats(self.prefill)
            stats["prefill"]["rows"] = _rows_stats(self.prefill_rows)
            stats["prefill"]["whole"] = _segmented_stats(self.prefill_whole)
        return stats


def _segmented_stats(runner: SegmentedRunner | None) -> dict[str, Any] | None:
    if runner is None:
        return None
    stats = runner.stats()
    stats["groups_detail"] = [asdict(info) for info in runner.group_infos()]
    return stats


def _rows_stats(rows: GraphRunner | None) -> dict[str, Any] | None:
    if rows is None:
        return None
    stats = rows.stats()
    stats["graphs"] = [asdict(info) for info in rows.entries()]
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
    max_num_seqs: int | None = None,
) -> EngineGraphs | GraphCapability:
    """The engine's graphs, started, when the capability check passes; else why not."""
    capability = check_capability(config, forward, scheduler_kv, device)
    if capability is not GraphCapability.ENABLED:
        log.info("graphguard decode graphs off: %s", capability.value)
        if config.manifest:
            log.info("graphguard manifest %s unused: graphs off", config.manifest)
        return capability
    graphs = EngineGraphs(config, forward, device, model_identity, role, max_num_seqs)
    log.info(
        "graphguard decode graphs on: backend=%s buckets=%s budget=%d bytes",
        config.backend,
        list(config.batch_buckets),
        config.max_bytes,
    )
    if graphs.prefill is not None:
        rows = graphs.prefill_rows is not None
        whole = graphs.prefill_whole is not None
        log.info(
            "graphguard prefill graphs on: %s%d segments%s",
            f"whole graphs up to {ROW_PREFILL_TOKENS} tokens as rows, above them " if rows else "",
            graphs.prefill.num_segments,
            ", and whole graphs of the packed prefills that recur" if whole else "",
        )
    else:
        log.info("graphguard prefill graphs off: prefill=False")
    graphs.start(warmup_keys, prefill_tokens)
    return graphs
