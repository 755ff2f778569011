"""Segmented prefill: graphed embedding, projection and MLP segments; eager paged attention.

The decoder is cut around attention: one segment embeds the tokens (image embeddings spliced
in), then each layer's attention runs eagerly (variable-length causal attention over the paged
cache, host-side lengths), and the segment after it holds o_proj, the residual, the MLP and the
next layer's norm, q/k/v projections and RoPE. A model of L layers has L + 1 segments, and one
packed prefill shape (its token count) owns one group of them (graphguard.segmented).

The ops are those of DecoderModel.forward in the same order, so the pipeline run eagerly gives
the same hidden states; that eager run is also how image requests prefill when graphs are off.
Installed only when the decode graphs' capability proof passes (same backend, same budget size,
the same admission policy); GRAPHGUARD_DISABLE=1 turns it off per call.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from graphguard.core.admission import AdmissionConfig
from graphguard.core.metrics import GraphMetrics
from graphguard.core.reasons import EvictionCause
from graphguard.engine.attention import AttentionMetadata, paged_attention
from graphguard.engine.kv import PagedKVStorage
from graphguard.engine.models import DecoderModel
from graphguard.engine.models.layers import DecoderLayer
from graphguard.segmented import Carry, SegmentedRunner, Stage, run_eager, split_segments

if TYPE_CHECKING:
    from graphguard.engine.engine import LLMEngine
    from graphguard.engine.sequence import Sequence

log = logging.getLogger("graphguard")


@dataclass(frozen=True)
class ImageSplice:
    """Rows of the packed prefill whose input embeddings come from images."""

    rows: Tensor  # [n] int64, on gpu: indices into the packed tokens
    embeds: Tensor  # [n, hidden], on gpu, model dtype


@dataclass(frozen=True)
class PrefillContext:
    """What the eager attention stages read: host-side lengths and the KV cache."""

    meta: AttentionMetadata
    kv: PagedKVStorage


def prefill_stages(model: DecoderModel) -> list[Stage]:
    """The decoder as stages: embed, then per layer pre-attention | attention | post-attention."""
    stages = [Stage("embed", _embed(model))]
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        stages.append(Stage(f"pre{index}", _pre_attention(layer)))
        stages.append(Stage(f"attn{index}", _attention(index, layer), eager=True))
        stages.append(Stage(f"post{index}", _post_attention(layer)))
    stages.append(Stage("norm", lambda h, cos, sin: (model.norm(h),)))
    return stages


def _embed(model: DecoderModel) -> Any:
    def embed(ids: Tensor, positions: Tensor, image_mask: Tensor, image_h: Tensor) -> Carry:
        h = model.embed_tokens(ids)
        # NOTE: where() copies h exactly where the mask is false, so text rows match forward().
        h = torch.where(image_mask[:, None], image_h, h)
        cos, sin = model.rotary(positions, h.dtype)
        return h, cos, sin

    return embed


def _pre_attention(layer: DecoderLayer) -> Any:
    def pre(h: Tensor, cos: Tensor, sin: Tensor) -> Carry:
        return h, *layer.pre_attention(h, cos, sin), cos, sin

    return pre


def _attention(index: int, layer: DecoderLayer) -> Any:
    scale = layer.self_attn.scale

    def attention(ctx: PrefillContext, h: Tensor, q: Tensor, k: Tensor, v: Tensor, *rope: Tensor):
        k_cache, v_cache = ctx.kv.k_cache[index], ctx.kv.v_cache[index]
        return (h, paged_attention(q, k, v, k_cache, v_cache, ctx.meta, scale), *rope)

    return attention


def _post_attention(layer: DecoderLayer) -> Any:
    def post(h: Tensor, out: Tensor, cos: Tensor, sin: Tensor) -> Carry:
        return layer.post_attention(h, out), cos, sin

    return post


def image_splice(
    seqs: list[Sequence], device: torch.device, chunks: list[int] | None = None
) -> ImageSplice | None:
    """Where the packed prefill of `seqs` (the next `chunks` uncached tokens of each, default
    all) takes image embeddings; None without images."""
    rows: list[int] = []
    parts: list[Tensor] = []
    start = 0
    for index, seq in enumerate(seqs):
        cached = seq.num_cached_tokens
        chunk = seq.num_tokens - cached if chunks is None else chunks[index]
        picked = [j for j, pos in enumerate(seq.image_positions) if cached <= pos < cached + chunk]
        if picked and seq.image_embeds is not None:
            rows += [start + seq.image_positions[j] - cached for j in picked]
            parts.append(seq.image_embeds[picked])
        start += chunk
    if not rows:
        return None
    rows_gpu = torch.tensor(rows, dtype=torch.int64, device=device)
    return ImageSplice(rows_gpu, torch.cat(parts).to(device))


def prefill_inputs(model: DecoderModel, ids: Tensor, positions: Tensor, splice: Any) -> Carry:
    """The pipeline's input carry: ids, positions, image row mask and image rows [T, hidden]."""
    num_tokens, weight = ids.shape[0], model.embed_tokens.weight
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=ids.device)
    image_h = torch.zeros(num_tokens, weight.shape[1], dtype=weight.dtype, device=ids.device)
    if splice is not None:
        mask[splice.rows] = True
        image_h.index_copy_(0, splice.rows, splice.embeds.to(weight.dtype))
    return ids, positions, mask, image_h


def eager_prefill(
    model: DecoderModel,
    kv: PagedKVStorage,
    ids: Tensor,
    positions: Tensor,
    meta: AttentionMetadata,
    splice: ImageSplice | None,
) -> Tensor:
    """Prefill hidden states ``[T, hidden]`` without graphs, image rows spliced in."""
    if splice is None:
        return model(ids, positions, meta, kv)
    pieces = split_segments(prefill_stages(model))
    carry = prefill_inputs(model, ids, positions, splice)
    return run_eager(pieces, carry, PrefillContext(meta, kv))[0]


class PrefillGraphs:
    """A prefill_fn for ModelRunner: the segmented pipeline under a SegmentedRunner."""

    def __init__(
        self,
        engine: LLMEngine,
        backend: str = "auto",
        admission: AdmissionConfig | None = None,
        metrics: GraphMetrics | None = None,
    ) -> None:
        self.model, self.kv = engine.model, engine.kv
        self.runner = SegmentedRunner(
            prefill_stages(engine.model),
            max_bytes=engine.config.max_graph_bytes,
            backend=backend,
            device=engine.device if backend != "sim" else None,
            admission=admission,
            retain=(engine.kv, engine.model),
            metrics=metrics,
            name="prefill",
        )

    def __call__(
        self, ids: Tensor, positions: Tensor, meta: AttentionMetadata, splice: ImageSplice | None
    ) -> Tensor:
        inputs = prefill_inputs(self.model, ids, positions, splice)
        return self.runner(inputs, PrefillContext(meta, self.kv))[0]

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


def install_prefill_graphs(engine: LLMEngine, admission: AdmissionConfig | None = None) -> bool:
    """Put segmented prefill under the engine when its decode graphs passed the capability
    proof (the same conditions); returns whether it did."""
    backend = engine.config.graph_backend
    if engine.graphs is None:  # the decode graphs' capability proof failed (or eager forced)
        return False
    if not engine.config.prefill_graphs:
        log.info("graphguard prefill graphs off: prefill_graphs=False")
        return False
    metrics = engine.graphs.metrics  # one registry for the decode and prefill graphs
    graphs = PrefillGraphs(engine, backend=backend, admission=admission, metrics=metrics)
    engine.prefill_graphs = graphs
    engine.runner.prefill_fn = graphs
    engine.on_reload.append(graphs.invalidate)
    log.info("graphguard prefill graphs on: %d segments", graphs.runner.num_segments)
    return True
