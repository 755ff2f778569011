"""Decode through CUDA graphs: a decode_fn of the same signature as EagerForward.decode.

Keys are (batch bucket, block-table width bucket): the runner pads the batch up to a bucket
(padded rows read and write only the reserved dummy KV block) and ModelRunner pads the width up
to a power of two. Built by graphguard/engine/graphs.py once the capability check passed.

Lock order: the engine's lifecycle lock (held by step/reload/shutdown), then the graph
runner's lock, then its cache's lock.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.backends import Backend
from graphguard.core.capture import WarmupReport
from graphguard.core.export import export_manifest
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.prewarm import prewarm
from graphguard.core.reasons import EvictionCause
from graphguard.core.verify import VerifyConfig
from graphguard.engine.config import EngineConfig
from graphguard.engine.forward import DECODE_PAD, EagerForward, padding_decode_batch
from graphguard.engine.kv import MIN_WIDTH_BLOCKS, width_bucket
from graphguard.engine.parallel.agreement import RankRunner
from graphguard.engine.parallel.ranks import RankRole

log = logging.getLogger("graphguard")


class DecodeGraphs:
    """Decode steps replayed from graphs, keyed by (batch bucket, width bucket)."""

    def __init__(
        self,
        forward: EagerForward,
        *,
        buckets: tuple[int, ...],
        max_bytes: int,
        backend: str | Backend,
        device: torch.device,
        metrics: GraphMetrics,
        model_identity: dict[str, Any],
        admission: AdmissionConfig | None = None,
        verify: str = "exact",
        reverify_every: int = 0,
        background: bool = False,
        max_pad_factor: int = 1,
        role: RankRole | None = None,
    ) -> None:
        self.metrics = metrics
        self.kv_bytes = forward.kv.kv_bytes
        # What a manifest must match to prewarm these graphs: model, shapes, dtype, KV layout.
        self.model_identity = model_identity
        self.buckets = Buckets(batch=buckets, pad_value=DECODE_PAD)
        options: dict[str, Any] = dict(
            buckets=self.buckets,
            max_bytes=max_bytes,
            verify=VerifyConfig(verify, reverify_every=reverify_every),
            admission=admission,
            capture=CaptureConfig(
                # NOTE: a capture between steps runs on all-padding batches (the buckets' pad
                # values): it reads and writes only the dummy block, never a live sequence's KV.
                background=background,
                retain=(forward.kv, forward.model),
                device=device if backend != "sim" else None,
                # NOTE: the logits are views of the graph's output, valid until its next
                # replay: the step samples from them before it returns (no [B, vocab] copy).
                copy_outputs=False,
                # NOTE: a batch with no graph of its own may ride a larger admitted one; its
                # extra rows are padding, as in its own bucket
                max_pad_factor=max_pad_factor,
            ),
            backend=backend,
            metrics=metrics,
            name="decode",
        )
        # a tensor-parallel rank's runner: rank 0 decides, every rank follows and agrees
        self.runner = (
            GraphRunner(forward.decode, **options)
            if role is None
            else RankRunner(forward.decode, role.orders, role.agreement, **options)
        )

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        slot_mapping: Tensor,
    ) -> Tensor:
        return self.runner(input_ids, positions, block_tables, seq_lens, slot_mapping)

    def warmup(
        self, batch_sizes: Iterable[int], widths: Iterable[int], progress: bool = True
    ) -> WarmupReport:
        """Capture the (batch, width) keys up front, largest first, within the byte budget.

        The warm-up batches are all padding: every row reads and writes only the dummy block.
        """
        device = self.runner.backend.device if self.runner.backend is not None else "cpu"
        examples = [padding_decode_batch(b, w, device) for b in batch_sizes for w in widths]
        return self.runner.warmup(examples, progress=progress)

    def export(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Write the decode graphs' manifest, with the model identity, to `path`."""
        return export_manifest(self.runner, path, model=self.model_identity)

    def prewarm(self, manifest: Any, progress: bool = True) -> WarmupReport:
        """Capture the manifest's decode keys; refused (lazy start) for another model."""
        return prewarm(self.runner, manifest, progress=progress, model=self.model_identity)

    def invalidate(self) -> None:
        """Retire every graph (new weights): called before the weights change."""
        count = self.runner.invalidate(EvictionCause.INVALIDATE)
        log.info("graphguard decode graphs invalidated: %d retired", count)

    def advance_capture(self) -> bool:
        """One unit of the decode capture in flight between steps; True while one remains."""
        return self.runner.advance_capture()

    @property
    def capture_in_flight(self) -> GraphKey | None:
        return self.runner.capture_in_flight

    def close(self) -> None:
        self.runner.close()

    def stats(self) -> dict[str, Any]:
        stats = self.runner.stats()
        stats["kv_bytes"] = self.kv_bytes
        stats["graphs"] = [asdict(info) for info in self.runner.entries()]
        return stats


def warmup_shapes(
    config: EngineConfig, max_model_len: int | None = None
) -> tuple[list[int], list[int]]:
    """The decode batch buckets and block-table widths that a server with `config` can run.

    Batch buckets stop at the first one that holds max_num_seqs rows; widths are the powers of
    two from MIN_WIDTH_BLOCKS up to the padded width of a `max_model_len` sequence (the
    engine's own, which the model's position limit may make shorter than
    config.max_model_len).
    """
    buckets = sorted(config.graphs.batch_buckets)
    cap = next((b for b in buckets if b >= config.max_num_seqs), buckets[-1])
    length = config.max_model_len if max_model_len is None else max_model_len
    max_width = width_bucket(-(-length // config.block_size))
    widths = [1 << i for i in range(max_width.bit_length()) if 1 << i >= MIN_WIDTH_BLOCKS]
    return [b for b in buckets if b <= cap], widths
