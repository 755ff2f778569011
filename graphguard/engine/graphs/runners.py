"""The engine's three graph runners, built from its graph config: what each step replays.

- `decode`: a GraphRunner of `EagerForward.decode`, keyed by (batch bucket, width bucket); a
  batch pads its rows up to a bucket (engine/shapes.py), padding rows read and write only the
  dummy KV block.
- `prefill_rows`: a GraphRunner of `EagerForward.rows` for short prefills run as rows
  (shapes.py `prefills_as_rows`), keyed by (row bucket, width bucket) like a decode key; None
  where the kernel set runs no prefill as rows.
- `prefill`: a SegmentedRunner of the prefill pipeline (models/forward.py cuts the decoder
  around attention: a model of L layers has L + 1 capturable segments), one group of segments
  per packed token bucket, for every other prefill.
- `prefill_whole`: where the kernel set's packed attention reads only device tensors
  (`whole_prefill_graphs`), a SegmentedRunner of the pipeline's whole form: one segment, one
  graph per (token, sequence, width) bucket that traffic earns; a packed prefill without its
  graph is answered by `prefill`'s segments, not eagerly.

Each runs eagerly with one named reason whenever it does not replay. A capture between steps
runs on dummy inputs: padding rows for a decode or rows key, and for a group one fresh sequence
whose K/V all go to the dummy block (as the padding of a real prefill does), so none writes a
slot that a live sequence reads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from graphguard.core.backends import Backend
from graphguard.core.graph_runner import GraphRunner
from graphguard.core.keys import Buckets, GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.options import CaptureConfig
from graphguard.core.verify import VerifyConfig
from graphguard.engine.config import GraphConfig
from graphguard.engine.models.forward import (
    EagerForward,
    PrefillContext,
    dummy_prefill_inputs,
    prefill_inputs,
    prefill_stages,
)
from graphguard.engine.parallel.agreement import RankRunner
from graphguard.engine.parallel.ranks import RankRole
from graphguard.engine.shapes import DECODE_PAD, ROW_BUCKETS
from graphguard.segmented import Carry, SegmentedRunner


def decode_runner(
    forward: EagerForward,
    config: GraphConfig,
    backend: str | Backend,
    metrics: GraphMetrics,
    role: RankRole | None = None,
) -> GraphRunner:
    """Decode steps from graphs; a tensor-parallel rank's runner when `role` is given (rank 0
    decides, every rank follows and agrees)."""
    options: dict[str, Any] = dict(
        buckets=Buckets(batch=config.batch_buckets, pad_value=DECODE_PAD),
        max_bytes=config.max_bytes,
        verify=VerifyConfig(config.verify, reverify_every=config.reverify_every),
        admission=config.admission,
        # NOTE: the logits are views of the graph's output, valid until its next replay: the
        # step samples from them before it returns (no copy of [B, vocab] per step).
        capture=_capture(forward, backend, config.background_capture, config.decode_pad_factor),
        backend=backend,
        metrics=metrics,
        name="decode",
    )
    if role is None:
        return GraphRunner(forward.decode, **options)
    return RankRunner(forward.decode, role.orders, role.agreement, **options)


def rows_runner(
    forward: EagerForward, config: GraphConfig, backend: str | Backend, metrics: GraphMetrics
) -> GraphRunner | None:
    """Prefills run as rows from graphs, or None where the kernel set runs none as rows. The
    hidden states are views of the graph's output: the step takes its logits from them before
    it returns."""
    if forward.model.kernels.row_prefill_area <= 0:
        return None
    return GraphRunner(
        forward.rows,
        buckets=Buckets(batch=ROW_BUCKETS, pad_value=DECODE_PAD),
        max_bytes=config.max_bytes,
        verify=config.verify,
        admission=config.prefill_admission,
        capture=_capture(forward, backend, config.background_capture, config.row_pad_factor),
        backend=backend,
        metrics=metrics,
        name="prefill_rows",
    )


def segmented_runner(
    forward: EagerForward, config: GraphConfig, backend: str | Backend, metrics: GraphMetrics
) -> SegmentedRunner:
    """Packed prefills through segment graphs, eager attention between them."""
    return _pipeline_runner(forward, config, backend, metrics, whole=False)


def whole_prefill_runner(
    forward: EagerForward,
    config: GraphConfig,
    backend: str | Backend,
    metrics: GraphMetrics,
    segments: SegmentedRunner,
) -> SegmentedRunner | None:
    """Packed prefills as whole graphs (the pipeline's whole form: one segment), or None where
    the kernel set's prefill attention needs host-side lengths. A call without its graph is
    answered by `segments` (its carry without the metadata's tensors), timed as the eager
    call would be: a key is captured when its replays would repay the capture against the
    segments, the engine's alternative, not against an eager forward."""
    if not forward.model.kernels.whole_prefill_graphs:
        return None

    def by_segments(call: tuple[Carry, PrefillContext]) -> Carry:
        carry, context = call
        return segments(carry[:SEGMENT_INPUTS], context)

    return _pipeline_runner(forward, config, backend, metrics, whole=True, fallback=by_segments)


def _pipeline_runner(
    forward: EagerForward,
    config: GraphConfig,
    backend: str | Backend,
    metrics: GraphMetrics,
    whole: bool,
    fallback: Callable[[tuple[Carry, PrefillContext]], Carry] | None = None,
) -> SegmentedRunner:
    """A SegmentedRunner of the prefill pipeline, its segments' form or its whole form."""
    examples = dummy_whole_prefill if whole else dummy_prefill
    return SegmentedRunner(
        prefill_stages(forward.model, forward.kv, whole=whole),
        max_bytes=config.max_bytes,
        verify=config.verify,
        admission=config.prefill_admission,
        capture=CaptureConfig(
            background=config.background_capture,
            examples=partial(examples, forward),
            retain=(forward.kv, forward.model),
            device=_device(forward, backend),
        ),
        backend=backend,
        metrics=metrics,
        name="prefill_whole" if whole else "prefill",
        fallback=fallback,
    )


# ids, positions, image mask, image rows, slots: what the segments' carry holds; the whole
# form's carry adds the block tables, the sequence lengths and the query starts
SEGMENT_INPUTS = 5


def dummy_prefill(forward: EagerForward, key: GraphKey) -> tuple[Carry, PrefillContext]:
    """The pipeline's inputs for a prefill of `key`'s token count that writes only the dummy
    block: one fresh sequence of token 0."""
    device = forward.model.embed_tokens.weight.device
    ids, positions, meta = dummy_prefill_inputs(key.args[0].shape[0], forward.kv, device)
    carry = prefill_inputs(forward.model, ids, positions, None, meta)
    return carry, PrefillContext(meta, forward.kv)


def dummy_whole_prefill(forward: EagerForward, key: GraphKey) -> tuple[Carry, PrefillContext]:
    """The whole form's inputs for `key` that write only the dummy block: one fresh sequence
    of the key's tokens, then empty ones up to its sequences, over tables of its width."""
    device = forward.model.embed_tokens.weight.device
    num_seqs, width = key.args[-3].shape  # ..., block tables, sequence lengths, query starts
    ids, positions, meta = dummy_prefill_inputs(
        key.args[0].shape[0], forward.kv, device, num_seqs=num_seqs, width=width
    )
    carry = prefill_inputs(forward.model, ids, positions, None, meta, whole=True)
    return carry, PrefillContext(meta, forward.kv)


def _capture(
    forward: EagerForward, backend: str | Backend, background: bool, max_pad_factor: int
) -> CaptureConfig:
    """How a runner of rows (decode, or a prefill run as rows) captures: between steps when
    asked (on all-padding rows), outputs returned as views, a call without its own graph
    riding a larger admitted bucket up to `max_pad_factor` (its extra rows padding)."""
    return CaptureConfig(
        background=background,
        retain=(forward.kv, forward.model),
        device=_device(forward, backend),
        copy_outputs=False,
        max_pad_factor=max_pad_factor,
    )


def _device(forward: EagerForward, backend: str | Backend) -> torch.device | None:
    return None if backend == "sim" else forward.model.embed_tokens.weight.device
