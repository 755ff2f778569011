"""The eager forward passes the engine runs when no graph does, and the reference for graphs.

`EagerForward` holds the two step functions over one model and its paged KV cache: `decode`
(one token per row, logits) and `prefill` (packed tokens, hidden states, image rows spliced in).
The graph runners capture exactly these, so graphs and eager share one definition.

The prefill pipeline: the decoder cut around attention. One stage embeds the tokens (image
embeddings spliced in), then each layer's attention runs eagerly (variable-length causal
attention over the paged cache, host-side lengths), and the stage after it holds o_proj, the
residual add and norm and the MLP; the next layer's stage before attention holds its residual
add and norm, the q/k/v projection, RoPE and the layer's K/V write (so a graph replays the
write, and the eager stage is the attention launch alone). The ops are those of
DecoderModel.forward in the same order, so the pipeline run eagerly gives the same hidden
states; graphguard.segmented captures its capturable stages (engine/graphs/runners.py), and the
same pipeline run eagerly is how image requests prefill when graphs are off.

Where the kernel set's packed attention reads only device tensors (`whole_prefill_graphs`: the
fused set's one launch), the same pipeline has a whole form (`whole=True`): the block tables,
sequence lengths and query starts travel in the carry, every stage is capturable, and the
pipeline is one segment, a packed prefill one graph keyed by its tokens, its sequences and its
table width, each padded to a bucket (engine/step/model_runner.py), instead of a graph replay
and an eager launch per layer (engine/graphs/runners.py `whole_prefill_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from graphguard.engine.models import DecoderModel
from graphguard.engine.models.attention import AttentionMetadata, plan_prefill_groups
from graphguard.engine.models.layers import DecoderLayer
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.shapes import DECODE_PAD, MIN_PREFILL_TOKENS, MIN_WIDTH_BLOCKS, ROW_BUCKETS
from graphguard.kernels.reference import write_kv
from graphguard.segmented import Carry, Stage, run_eager, split_segments

if TYPE_CHECKING:
    from graphguard.engine.scheduling.sequence import Sequence


def padding_decode_batch(rows: int, width: int, device: Any) -> tuple[Tensor, ...]:
    """decode's arguments for `rows` padding rows of a `width`-block table: they read and
    write only the dummy block."""

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


def row_meta(slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor) -> AttentionMetadata:
    """The metadata of rows that each attend over their own paged context (one query token
    per row, its K/V written first): decode_attention's calling convention."""
    num_rows = slot_mapping.shape[0]
    return AttentionMetadata(
        packed=False,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=slot_mapping.device),
    )


WARM_UP_ROWS = (1, 2, 16)  # one decode batch of each class of Triton's integer specialization


class EagerForward:
    """The step functions of one model over one paged KV cache, without graphs."""

    def __init__(self, model: DecoderModel, kv: PagedKVStorage) -> None:
        self.model = model
        self.kv = kv

    def decode(
        self,
        input_ids_gpu: Tensor,
        positions_gpu: Tensor,
        block_tables_gpu: Tensor,
        seq_lens_gpu: Tensor,
        slot_mapping_gpu: Tensor,
    ) -> Tensor:
        """Logits [B, vocab] of one query token per row: the model's forward and LM head."""
        hidden = self.rows(
            input_ids_gpu, positions_gpu, block_tables_gpu, seq_lens_gpu, slot_mapping_gpu
        )
        with torch.no_grad():
            return self.model.compute_logits(hidden)

    def rows(
        self,
        input_ids_gpu: Tensor,
        positions_gpu: Tensor,
        block_tables_gpu: Tensor,
        seq_lens_gpu: Tensor,
        slot_mapping_gpu: Tensor,
    ) -> Tensor:
        """Hidden states [B, hidden] of one query token per row, each over its paged context
        (its own K/V written first): a decode batch, or a prefill whose tokens are the rows
        (`prefills_as_rows`). Takes decode's arguments."""
        meta = row_meta(slot_mapping_gpu, block_tables_gpu, seq_lens_gpu)
        with torch.no_grad():
            return self.model(input_ids_gpu, positions_gpu, meta, self.kv)

    def warm_up(self) -> None:
        """Decodes of one and of several attention splits and a short prefill, all in the
        dummy block, so kernel compiles and library first calls happen here rather than in the
        first requests' steps.

        NOTE: Triton compiles a kernel again for each class of its integer arguments (1, a
        multiple of 16, any other), so the decodes take batches of 1, 2 and 16 rows: an eager
        step of 11 rows or a graph of 16 then finds its kernels compiled. Where prefills run
        as rows, one of each token bucket runs too: the first prefill of 128 rows took half as
        long again as later ones (the GEMMs' first calls at that size), and without it the
        first requests paid for that (docs/benchmarks.md, "Design notes")."""
        device = self.model.embed_tokens.weight.device
        for rows in WARM_UP_ROWS:
            for width in (MIN_WIDTH_BLOCKS, 4 * MIN_WIDTH_BLOCKS):
                self.decode(*padding_decode_batch(rows, width, device))
        self.prefill(*dummy_prefill_inputs(MIN_PREFILL_TOKENS, self.kv, device), None)
        if self.model.kernels.row_prefill_area > 0:
            for rows in ROW_BUCKETS:
                self.rows(*padding_decode_batch(rows, MIN_WIDTH_BLOCKS, device))

    def prefill(
        self,
        ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        splice: ImageSplice | None,
    ) -> Tensor:
        """Hidden states [T, hidden] of the packed prompt tokens, image rows spliced in."""
        return eager_prefill(self.model, self.kv, ids, positions, meta, splice)


def dummy_prefill_inputs(
    num_tokens: int,
    kv: PagedKVStorage,
    device: torch.device,
    num_seqs: int = 1,
    width: int | None = None,
) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """ids, positions and metadata of a prefill of `num_tokens` that writes only the dummy
    block: one fresh sequence of token 0, then `num_seqs` - 1 empty ones (as a step's sequences
    are padded to a bucket), tables `width` blocks wide (default: as the tokens need)."""
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    dummy, block_size = PagedKVStorage.DUMMY_BLOCK, kv.block_size
    width = -(-num_tokens // block_size) if width is None else width
    seq_lens = [num_tokens] + [0] * (num_seqs - 1)

    def ints(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        packed=True,
        slot_mapping=dummy * block_size + positions % block_size,
        block_tables=torch.full((num_seqs, width), dummy, dtype=torch.int32, device=device),
        seq_lens=ints(seq_lens),
        query_start_loc=ints([0] + [num_tokens] * num_seqs),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=list(seq_lens),
        prefill_groups=plan_prefill_groups(seq_lens, seq_lens, device),
    )
    return ids, positions, meta


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


def prefill_stages(model: DecoderModel, kv: PagedKVStorage, whole: bool = False) -> list[Stage]:
    """The decoder as stages over the KV cache `kv`: embed, then per layer pre-attention |
    attention | post-attention, then the final norm. Between layers the carry is (h, residual,
    cos, sin, slots, *tables): the residual stream travels unadded, as in DecoderModel.forward
    (the first layer has none yet), and the tokens' cache slots go to each layer's K/V write.
    Attention is eager and reads the metadata from the call's PrefillContext; in the `whole`
    form (a kernel set with `whole_prefill_graphs`) the metadata's tensors travel in the carry
    too (block tables, sequence lengths, query starts: `prefill_inputs(..., whole=True)`),
    read by attention stages that are capturable themselves."""
    if whole and not model.kernels.whole_prefill_graphs:
        name = model.kernels.name
        raise ValueError(f"the {name} kernels' prefill attention needs host-side lengths")
    stages = [Stage("embed", _embed(model))]
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        pre = _pre_attention(model, kv, index, layer, first=index == 0)
        stages.append(Stage(f"pre{index}", pre))
        if whole:
            attention = _whole_attention(model, kv, index, layer)
        else:
            attention = _attention(model, index, layer)
        stages.append(Stage(f"attn{index}", attention, eager=not whole))
        stages.append(Stage(f"post{index}", _post_attention(model, layer)))
    stages.append(Stage("norm", _final_norm(model)))
    return stages


def _embed(model: DecoderModel) -> Any:
    def embed(
        ids: Tensor, positions: Tensor, image_mask: Tensor, image_h: Tensor, *tail: Tensor
    ) -> Carry:
        h = model.embed_tokens(ids)
        # NOTE: where() copies h exactly where the mask is false, so text rows match forward().
        h = torch.where(image_mask[:, None], image_h, h)
        cos, sin = model.rotary(positions, h.dtype)
        return h, cos, sin, *tail  # tail: the slots, then the metadata's tensors if whole

    return embed


def _pre_attention(
    model: DecoderModel, kv: PagedKVStorage, index: int, layer: DecoderLayer, first: bool
) -> Any:
    def pre(h: Tensor, *carry: Tensor) -> Carry:
        residual = None if first else carry[0]
        tail = carry if first else carry[1:]  # cos, sin, slots, then the metadata's if whole
        cos, sin, slots = tail[:3]
        qkv, residual = layer.norm_qkv(h, residual, model.kernels)
        q, k, v = layer.self_attn.rope(qkv, (cos, sin), model.kernels)
        # NOTE: idempotent (same slots, same values), as a graph's warm-ups and the parity
        # check's eager run need; a capture on dummy inputs writes only the dummy block.
        write_kv(kv.k_cache[index], kv.v_cache[index], k, v, slots)
        return residual, q, k, v, *tail

    return pre


def _attention(model: DecoderModel, index: int, layer: DecoderLayer) -> Any:
    scale = layer.self_attn.scale

    def attention(ctx: PrefillContext, residual: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest):
        kv_cache = (ctx.kv.k_cache[index], ctx.kv.v_cache[index])  # the new K/V written
        out = model.kernels.prefill_attention(q, k, v, kv_cache, ctx.meta, scale)
        return (residual, out, *rest)

    return attention


def _whole_attention(
    model: DecoderModel, kv: PagedKVStorage, index: int, layer: DecoderLayer
) -> Any:
    """A layer's attention as a capturable stage: the metadata from the carry's tensors."""
    scale = layer.self_attn.scale

    def attention(residual: Tensor, q: Tensor, k: Tensor, v: Tensor, *tail: Tensor) -> Carry:
        _, _, slots, tables, seq_lens, query_start = tail
        meta = AttentionMetadata(
            packed=True, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
            query_start_loc=query_start,
        )  # fmt: skip
        kv_cache = (kv.k_cache[index], kv.v_cache[index])  # the new K/V written
        out = model.kernels.prefill_attention(q, k, v, kv_cache, meta, scale)
        return (residual, out, *tail)

    return attention


def _post_attention(model: DecoderModel, layer: DecoderLayer) -> Any:
    def post(residual: Tensor, out: Tensor, *rest: Tensor) -> Carry:
        attn_out = layer.self_attn.project_out(out, model.kernels)
        h, residual = layer.mlp_block(attn_out, residual, model.kernels)
        return h, residual, *rest

    return post


def _final_norm(model: DecoderModel) -> Any:
    def norm(h: Tensor, *carry: Tensor) -> Carry:
        residual = carry[0] if len(model.layers) else None
        return (model.final_norm(h, residual),)

    return norm


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


def prefill_inputs(
    model: DecoderModel,
    ids: Tensor,
    positions: Tensor,
    splice: Any,
    meta: AttentionMetadata,
    whole: bool = False,
) -> Carry:
    """The pipeline's input carry: ids, positions, image row mask, image rows [T, hidden], the
    tokens' cache slots and, for the `whole` form, the block tables, sequence lengths and
    query starts."""
    num_tokens, weight = ids.shape[0], model.embed_tokens.weight
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=ids.device)
    image_h = torch.zeros(num_tokens, weight.shape[1], dtype=weight.dtype, device=ids.device)
    if splice is not None:
        mask[splice.rows] = True
        image_h.index_copy_(0, splice.rows, splice.embeds.to(weight.dtype))
    carry: Carry = (ids, positions, mask, image_h, meta.slot_mapping)
    if whole:
        carry += (meta.block_tables, meta.seq_lens, meta.query_start_loc)
    return carry


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
    pieces = split_segments(prefill_stages(model, kv))
    carry = prefill_inputs(model, ids, positions, splice, meta)
    return run_eager(pieces, carry, PrefillContext(meta, kv))[0]
