"""Prefill graphs: whole graphs for short prefills, segmented graphs for the rest.

A short prefill without images runs as rows (graphguard/engine/forward.py `prefills_as_rows`):
its shapes depend only on (tokens, table width), so it is one graph per key, captured like a
decode key (`rows`, a GraphRunner of `EagerForward.rows` keyed by token bucket and width
bucket; padding rows read and write only the dummy block). Any other prefill runs the segmented
pipeline (graphguard/engine/forward.py cuts the decoder around attention: a model of L layers
has L + 1 capturable segments) under a SegmentedRunner, one group of segments per packed token
count. Built by graphguard/engine/graphs.py next to the decode graphs (same backend, same
budget size each); GRAPHGUARD_DISABLE=1 turns them off per call.

A capture between steps runs on dummy inputs: padding rows for a rows key, and for a group one
fresh sequence whose K/V all go to the reserved dummy block (as the padding of a real prefill
does), so neither writes a slot that a live sequence reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import Backend
from graphguard.core.capture import WarmupReport
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.reasons import EvictionCause
from graphguard.engine.attention import AttentionMetadata
from graphguard.engine.forward import (
    DECODE_PAD,
    MIN_PREFILL_TOKENS,
    POWER_OF_TWO_PREFILL_TOKENS,
    ROW_BUCKETS,
    EagerForward,
    ImageSplice,
    PrefillContext,
    dummy_prefill_inputs,
    padding_decode_batch,
    prefill_inputs,
    prefill_stages,
    prefills_as_rows,
)
from graphguard.engine.kv import MIN_WIDTH_BLOCKS, width_bucket
from graphguard.segmented import Carry, SegmentedRunner
from graphguard.segmented.group import carry_key

log = logging.getLogger("graphguard")


class PrefillGraphs:
    """A prefill_fn for ModelRunner: whole graphs of prefills run as rows (`rows`, None when
    the kernel set runs no prefill as rows) and the segmented pipeline under a
    SegmentedRunner (`runner`)."""

    def __init__(
        self,
        forward: EagerForward,
        *,
        max_bytes: int,
        backend: str | Backend,
        device: torch.device,
        metrics: GraphMetrics,
        admission: AdmissionConfig | None = None,
        verify: str = "exact",
        background: bool = False,
        max_pad_factor: int = 1,
    ) -> None:
        self.forward, self.model, self.kv = forward, forward.model, forward.kv
        self.block_size = forward.kv.block_size
        self.rows: GraphRunner | None = None
        if forward.model.kernels.row_prefill_area > 0:
            self.rows = GraphRunner(
                forward.rows,
                buckets=Buckets(batch=ROW_BUCKETS, pad_value=DECODE_PAD),
                max_bytes=max_bytes,
                verify=verify,
                admission=admission,
                capture=CaptureConfig(
                    background=background,
                    retain=(forward.kv, forward.model),
                    device=device if backend != "sim" else None,
                    # NOTE: the hidden states are views of the graph's output, valid until its
                    # next replay: the step takes its logits from them before it returns.
                    copy_outputs=False,
                    # a prefill with no graph of its own may ride a larger admitted bucket
                    max_pad_factor=max_pad_factor,
                ),
                backend=backend,
                metrics=metrics,
                name="prefill_rows",
            )
        self.runner = SegmentedRunner(
            prefill_stages(forward.model),
            max_bytes=max_bytes,
            verify=verify,
            admission=admission,
            capture=CaptureConfig(
                background=background,
                examples=self.dummy_prefill,
                retain=(forward.kv, forward.model),
                device=device if backend != "sim" else None,
            ),
            backend=backend,
            metrics=metrics,
            name="prefill",
        )

    def __call__(
        self, ids: Tensor, positions: Tensor, meta: AttentionMetadata, splice: ImageSplice | None
    ) -> Tensor:
        if not meta.is_prefill:  # run as rows (ModelRunner planned it)
            args = (ids, positions, meta.block_tables, meta.seq_lens, meta.slot_mapping)
            return self.rows(*args) if self.rows is not None else self.forward.rows(*args)
        inputs = prefill_inputs(self.model, ids, positions, splice)
        return self.runner(inputs, PrefillContext(meta, self.kv))[0]

    def dummy_prefill(self, key: GraphKey) -> tuple[Carry, PrefillContext]:
        """The pipeline's inputs for a prefill of `key`'s token count that writes only the
        dummy block: one fresh sequence of token 0 (see module docstring)."""
        device = self.model.embed_tokens.weight.device
        ids, positions, meta = dummy_prefill_inputs(key.args[0].shape[0], self.kv, device)
        carry = prefill_inputs(self.model, ids, positions, None)
        return carry, PrefillContext(meta, self.kv)

    def warmup(
        self,
        token_counts: Sequence[int],
        widths: Sequence[int] = (MIN_WIDTH_BLOCKS,),
        progress: bool = True,
    ) -> WarmupReport:
        """Capture the graphs of packed prefills of `token_counts` tokens at start, on dummy
        inputs (as a capture between steps runs on), largest first, within the budgets: for a
        count that can run as rows, one key per table width of `widths` (the engine's width
        buckets) that its prompts can have as rows (`_row_widths`); for others, up to
        POWER_OF_TWO_PREFILL_TOKENS, its group of segments. One report for both."""
        device = self.model.embed_tokens.weight.device
        examples: list[tuple[Tensor, ...]] = []
        keys = []
        for num_tokens in token_counts:
            row_widths = self._row_widths(num_tokens, widths)
            examples += [padding_decode_batch(num_tokens, w, device) for w in row_widths]
            if not row_widths and num_tokens <= POWER_OF_TWO_PREFILL_TOKENS:
                ids, positions, _ = dummy_prefill_inputs(num_tokens, self.kv, device)
                keys.append(carry_key(prefill_inputs(self.model, ids, positions, None)))
        report = WarmupReport()
        if self.rows is not None and examples:
            report = self.rows.warmup(examples, progress=progress)
        if keys:
            groups = self.runner.warm_keys(keys, progress=progress)
            report.captured += groups.captured
            report.skipped.update(groups.skipped)
            report.seconds += groups.seconds
        return report

    @property
    def knows_a_price(self) -> bool:
        """Whether the runner of the shortest prefills has admitted a capture (payback's
        price, graphguard/core/admission.py)."""
        as_rows = self._row_widths(MIN_PREFILL_TOKENS, (MIN_WIDTH_BLOCKS,))
        runner = self.rows if as_rows else self.runner
        assert runner is not None
        return runner.policy.knows_a_price

    def _row_widths(self, num_tokens: int, widths: Sequence[int]) -> list[int]:
        """The table widths of `widths` at which a prefill of `num_tokens` tokens runs as
        rows: up to the width of one prompt of that many tokens, while the shortest context
        that needs the width keeps the prefill within the kernel set's row area (2,048 short
        prompts' tokens run as rows, one 2,048-token prompt does not); none without rows."""
        if self.rows is None:
            return []
        top = width_bucket(-(-num_tokens // self.block_size))
        found = []
        for width in widths:
            shortest = 1 if width <= MIN_WIDTH_BLOCKS else (width // 2) * self.block_size + 1
            context = min(num_tokens, shortest)
            if width <= top and prefills_as_rows(self.model.kernels, num_tokens, context):
                found.append(width)
        return found

    def advance_capture(self) -> bool:
        """One unit of a prefill capture in flight between steps (a rows key's before a
        group's); True while one remains."""
        for runner in self._runners():
            if runner.capture_in_flight is not None:
                runner.advance_capture()
                break
        return self.capture_in_flight is not None

    @property
    def capture_in_flight(self) -> GraphKey | None:
        return next(
            (r.capture_in_flight for r in self._runners() if r.capture_in_flight is not None),
            None,
        )

    def _runners(self) -> list[GraphRunner | SegmentedRunner]:
        return [self.runner] if self.rows is None else [self.rows, self.runner]

    def invalidate(self) -> None:
        """Retire every graph (new weights): called before the weights change."""
        count = self.runner.invalidate(EvictionCause.INVALIDATE)
        rows = self.rows.invalidate(EvictionCause.INVALIDATE) if self.rows is not None else 0
        log.info("graphguard prefill graphs invalidated: %d rows graphs, %d groups", rows, count)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
        self.runner.close()

    def stats(self) -> dict[str, Any]:
        """The segmented groups' stats, with the rows graphs' under "rows" (None when no
        prefill runs as rows)."""
        stats = self.runner.stats()
        stats["groups_detail"] = [asdict(info) for info in self.runner.group_infos()]
        if self.rows is None:
            stats["rows"] = None
        else:
            stats["rows"] = self.rows.stats()
            stats["rows"]["graphs"] = [asdict(info) for info in self.rows.entries()]
        return stats
