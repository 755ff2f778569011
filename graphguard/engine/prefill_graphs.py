"""Segmented prefill graphs: EagerForward's prefill pipeline under a SegmentedRunner.

The pipeline (graphguard/engine/forward.py) cuts the decoder around attention; a model of L
layers has L + 1 capturable segments, and one packed prefill shape (its token count) owns one
group of them (graphguard.segmented). Built by graphguard/engine/graphs.py next to the decode
graphs (same backend, same budget size); GRAPHGUARD_DISABLE=1 turns it off per call.

A group captured between steps (background) runs on a dummy prefill of the key's token count:
one fresh sequence whose K/V all go to the reserved dummy block (as the padding of a real
prefill does), so it never writes a slot that a live sequence reads.
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
from graphguard.core.base import WarmupReport
from graphguard.core.keys import GraphKey
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import EvictionCause
from graphguard.engine.attention import AttentionMetadata
from graphguard.engine.forward import (
    EagerForward,
    ImageSplice,
    PrefillContext,
    dummy_prefill_inputs,
    prefill_inputs,
    prefill_stages,
)
from graphguard.segmented import Carry, SegmentedRunner
from graphguard.segmented.group import carry_key

log = logging.getLogger("graphguard")


class PrefillGraphs:
    """A prefill_fn for ModelRunner: the segmented pipeline under a SegmentedRunner."""

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
    ) -> None:
        self.model, self.kv = forward.model, forward.kv
        self.runner = SegmentedRunner(
            prefill_stages(forward.model),
            max_bytes=max_bytes,
            verify=verify,
            backend=backend,
            device=device if backend != "sim" else None,
            admission=admission,
            retain=(forward.kv, forward.model),
            metrics=metrics,
            name="prefill",
            background=background,
            examples=self.dummy_prefill,
        )

    def __call__(
        self, ids: Tensor, positions: Tensor, meta: AttentionMetadata, splice: ImageSplice | None
    ) -> Tensor:
        inputs = prefill_inputs(self.model, ids, positions, splice)
        return self.runner(inputs, PrefillContext(meta, self.kv))[0]

    def dummy_prefill(self, key: GraphKey) -> tuple[Carry, PrefillContext]:
        """The pipeline's inputs for a prefill of `key`'s token count that writes only the
        dummy block: one fresh sequence of token 0 (see module docstring)."""
        device = self.model.embed_tokens.weight.device
        ids, positions, meta = dummy_prefill_inputs(key.args[0].shape[0], self.kv, device)
        carry = prefill_inputs(self.model, ids, positions, None)
        return carry, PrefillContext(meta, self.kv)

    def warmup(self, token_counts: Sequence[int], progress: bool = True) -> WarmupReport:
        """Capture the groups of packed prefills of `token_counts` tokens at start, on dummy
        prefills (as a capture between steps runs on), largest first, within the budget."""
        device = self.model.embed_tokens.weight.device
        keys = []
        for num_tokens in token_counts:
            ids, positions, _ = dummy_prefill_inputs(num_tokens, self.kv, device)
            keys.append(carry_key(prefill_inputs(self.model, ids, positions, None)))
        return self.runner.warm_keys(keys, progress=progress)

    def advance_capture(self) -> bool:
        """One unit of the prefill group capture in flight between steps; True while one
        remains."""
        return self.runner.advance_capture()

    @property
    def capture_in_flight(self) -> GraphKey | None:
        return self.runner.capture_in_flight

    def invalidate(self) -> None:
        """Retire every group (new weights): called before the weights change."""
        count = self.runner.invalidate(EvictionCause.INVALIDATE)
        log.info("graphguard prefill graphs invalidated: %d groups retired", count)

    def close(self) -> None:
        self.runner.close()

    def stats(self) -> dict[str, Any]:
        stats = self.runner.stats()
        stats["groups_detail"] = [asdict(info) for info in self.runner.group_infos()]
        return stats
