"""Decode through CUDA graphs: the engine's decode_fn on top of the graph runtime.

Keys are (batch bucket, block-table width bucket): the runner pads the batch up to a bucket
(padded rows read and write only the reserved dummy KV block) and ModelRunner pads the width up
to a power of two. Graphs are installed only when every capability condition holds (deny by
default); the first failing condition is reported from a closed set.

Lock order: the engine's lifecycle lock (held by step/reload/shutdown), then the graph
runner's lock, then its cache's lock.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.export import export_manifest, model_identity
from graphguard.core.keys import Buckets
from graphguard.core.metrics import GraphMetrics
from graphguard.core.prewarm import prewarm
from graphguard.core.reasons import EvictionCause
from graphguard.core.runner import GraphRunner, WarmupReport, kill_switch_on
from graphguard.engine.config import EngineConfig
from graphguard.engine.kv import PagedKVStorage
from graphguard.engine.model_runner import width_bucket

if TYPE_CHECKING:
    from graphguard.engine.engine import LLMEngine

log = logging.getLogger("graphguard")

# Pad values of the decode inputs, by position: token 0, position 0, block table -> dummy
# block, sequence length 1 (a non-empty softmax), slot 0 (inside the dummy block).
DECODE_PAD = (0, 0, PagedKVStorage.DUMMY_BLOCK, 1, PagedKVStorage.DUMMY_BLOCK)
MIN_COMPUTE_CAPABILITY = (7, 0)


class GraphCapability(enum.StrEnum):
    """Whether decode graphs may run, and if not, the first condition that failed."""

    ENABLED = "enabled"
    ENFORCE_EAGER = "enforce_eager"
    KILL_SWITCH = "kill_switch"
    NO_CUDA = "no_cuda"
    UNSUPPORTED_ARCH = "unsupported_arch"
    KV_IDENTITY_MISMATCH = "kv_identity_mismatch"
    DEVICE_MISMATCH = "device_mismatch"


def check_capability(engine: LLMEngine, backend: str) -> GraphCapability:
    """The capability proof: every condition, in order; the first that fails is returned."""
    if engine.config.enforce_eager:
        return GraphCapability.ENFORCE_EAGER
    if kill_switch_on():
        return GraphCapability.KILL_SWITCH
    if backend != "sim":
        if engine.device.type != "cuda" or not torch.cuda.is_available():
            return GraphCapability.NO_CUDA
        if torch.cuda.get_device_capability(engine.device) < MIN_COMPUTE_CAPABILITY:
            return GraphCapability.UNSUPPORTED_ARCH
    # The KV view the scheduler allocates from and the one attention writes must be one object.
    if not (engine.runner.kv is engine.kv and engine.scheduler.kv is engine.kv):
        return GraphCapability.KV_IDENTITY_MISMATCH
    tensors = [*engine.kv.k_cache, *engine.kv.v_cache, *engine.model.parameters()]
    if any(t.device != engine.device for t in tensors):
        return GraphCapability.DEVICE_MISMATCH
    return GraphCapability.ENABLED


class DecodeGraphs:
    """A decode_fn of the same signature as ModelRunner.eager_decode, replayed from graphs."""

    def __init__(
        self,
        engine: LLMEngine,
        backend: str = "auto",
        admission: AdmissionConfig | None = None,
        metrics: GraphMetrics | None = None,
    ) -> None:
        self.enabled_reason = GraphCapability.ENABLED.value
        self.metrics = metrics or GraphMetrics()
        self.registry = self.metrics.registry
        self.kv_bytes = engine.kv.kv_bytes
        # What a manifest must match to prewarm these graphs: model, shapes, dtype, KV layout.
        self.model_identity = model_identity(
            engine.loaded.name,
            engine.model_config,
            dtype=engine.dtype,
            block_size=engine.config.block_size,
        )
        self.runner = GraphRunner(
            engine.runner.eager_decode,
            buckets=Buckets(batch=engine.config.batch_buckets, pad_value=DECODE_PAD),
            max_bytes=engine.config.max_graph_bytes,
            backend=backend,
            device=engine.device if backend != "sim" else None,
            admission=admission,
            retain=(engine.kv, engine.model),
            metrics=self.metrics,
            name="decode",
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
        examples = [_dummy_batch(b, w, device) for b in batch_sizes for w in widths]
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

    def close(self) -> None:
        self.runner.close()

    def stats(self) -> dict[str, Any]:
        stats = self.runner.stats()
        stats["enabled"] = True
        stats["reason"] = self.enabled_reason
        stats["kv_bytes"] = self.kv_bytes
        stats["graphs"] = [asdict(info) for info in self.runner.entries()]
        return stats


def _dummy_batch(rows: int, width: int, device: Any) -> tuple[Tensor, ...]:
    def full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> Tensor:
        return torch.full(shape, value, dtype=dtype, device=device)

    ids, pos, table, seq_len, slot = DECODE_PAD
    return (
        full((rows,), ids, torch.int64),
        full((rows,), pos, torch.int64),
        full((rows, width), table, torch.int32),
        full((rows,), seq_len, torch.int32),
        full((rows,), slot, torch.int64),
    )


def install_decode_graphs(engine: LLMEngine) -> GraphCapability:
    """Put decode graphs under the engine if the capability proof passes; say why if not."""
    backend = engine.config.graph_backend
    capability = check_capability(engine, backend)
    if capability is not GraphCapability.ENABLED:
        engine.graphs_disabled_reason = capability.value
        log.info("graphguard decode graphs off: %s", capability.value)
        if engine.config.graph_manifest:
            log.info("graphguard manifest %s unused: graphs off", engine.config.graph_manifest)
        return capability
    graphs = DecodeGraphs(engine, backend=backend)
    engine.graphs = graphs
    engine.runner.decode_fn = graphs
    engine.on_reload.append(graphs.invalidate)
    log.info(
        "graphguard decode graphs on: backend=%s buckets=%s budget=%d bytes",
        backend,
        list(engine.config.batch_buckets),
        engine.config.max_graph_bytes,
    )
    if engine.config.graph_manifest:
        _prewarm_from(graphs, engine.config.graph_manifest)
    if engine.config.warmup_graphs:
        batch_sizes, widths = warmup_shapes(engine.config, engine.max_model_len)
        report = graphs.warmup(batch_sizes, widths)
        log.info(
            "graphguard decode warmup: %d of %d keys captured in %.1f s",
            len(report.captured),
            len(batch_sizes) * len(widths),
            report.seconds,
        )
    return capability


def warmup_shapes(
    config: EngineConfig, max_model_len: int | None = None
) -> tuple[list[int], list[int]]:
    """The decode batch buckets and block-table widths that a server with `config` can run.

    Batch buckets stop at the first one that holds max_num_seqs rows; widths are the powers of
    two up to the padded width of a `max_model_len` sequence (the engine's own, which the
    model's position limit may make shorter than config.max_model_len).
    """
    buckets = sorted(config.batch_buckets)
    cap = next((b for b in buckets if b >= config.max_num_seqs), buckets[-1])
    length = config.max_model_len if max_model_len is None else max_model_len
    max_width = width_bucket(-(-length // config.block_size))
    widths = [1 << i for i in range(max_width.bit_length())]
    return [b for b in buckets if b <= cap], widths


def _prewarm_from(graphs: DecodeGraphs, manifest: str) -> None:
    # NOTE: a start never fails for a manifest: refusals and errors leave graphs lazy.
    try:
        graphs.prewarm(manifest)
    except Exception:  # noqa: BLE001
        log.exception("graphguard prewarm from %s failed; graphs will be captured lazily", manifest)
