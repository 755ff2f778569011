"""Turns a scheduled batch into model inputs and logits.

Prefills run as one call over the packed tokens of all prefilling sequences, through
``prefill_fn`` (eager; segmented prefill graphs may replace it), image rows spliced in. Decode rows
go through ``decode_fn``, which the graph layer may replace with a graph-backed callable of the
same signature; its inputs depend only on (num_seqs, width), with the block-table width padded
up to a power-of-two number of blocks so that few shapes recur.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from graphguard.engine.attention import AttentionMetadata, plan_prefill_groups
from graphguard.engine.kv import PagedKVStorage
from graphguard.engine.models import DecoderModel
from graphguard.engine.prefill_graphs import ImageSplice, eager_prefill, image_splice
from graphguard.engine.sampling import TokenLogprob, token_logprobs
from graphguard.engine.scheduler import ScheduledBatch
from graphguard.engine.sequence import Sequence

# decode_fn(input_ids_gpu[B], positions_gpu[B], block_tables_gpu[B, W], seq_lens_gpu[B],
#           slot_mapping_gpu[B]) -> logits[B, vocab] float32
DecodeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
# prefill_fn(input_ids_gpu[T], positions_gpu[T], meta, image splice or None) -> hidden[T, hidden]
PrefillFn = Callable[[Tensor, Tensor, AttentionMetadata, ImageSplice | None], Tensor]


# Rows of prompt logits computed at once for prompt logprobs (bounds rows x vocab floats).
PROMPT_LOGPROBS_CHUNK = 256


def width_bucket(num_blocks: int) -> int:
    """The power of two >= num_blocks: the padded block-table width of a decode batch."""
    return 1 << max(0, num_blocks - 1).bit_length()


class ModelRunner:
    """Prepares AttentionMetadata for scheduled sequences and runs the model."""

    def __init__(self, model: DecoderModel, kv: PagedKVStorage, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.decode_fn: DecodeFn = self.eager_decode
        self.prefill_fn: PrefillFn = self.eager_prefill

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> Tensor:
        """Logits [len(batch.seqs), vocab] float32, rows in ``batch.seqs`` order."""
        parts = []
        if batch.decodes:
            parts.append(self.decode(batch.decodes))
        if batch.prefills:
            parts.append(self.prefill(batch.prefills))
        # batch.seqs is decodes then prefills, so concatenation restores request order.
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def prefill(self, seqs: list[Sequence]) -> Tensor:
        """One eager forward over the packed uncached tokens; logits of each last token."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in seqs:
            new_positions = range(seq.num_cached_tokens, seq.num_tokens)
            input_ids += seq.token_ids[seq.num_cached_tokens :]
            positions += new_positions
            slots += [self._slot(seq, pos) for pos in new_positions]
        seq_lens = [seq.num_tokens for seq in seqs]
        query_lens = [seq.num_tokens - seq.num_cached_tokens for seq in seqs]
        query_start_loc = _cumsum0(query_lens)
        width = max(len(seq.block_table) for seq in seqs)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._block_tables(seqs, width),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
            prefill_groups=plan_prefill_groups(query_lens, seq_lens, self.device),
        )
        ids_gpu = self._tensor(input_ids, torch.int64)
        splice = image_splice(seqs, self.device)
        hidden = self.prefill_fn(ids_gpu, self._tensor(positions, torch.int64), meta, splice)
        for seq, start in zip(seqs, query_start_loc, strict=False):
            if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None:
                # NOTE: the first prefill of a request covers its whole prompt (nothing cached).
                seq.prompt_logprobs = self._prompt_logprobs(seq, hidden, start)
        last_rows = self._tensor([end - 1 for end in query_start_loc[1:]], torch.int64)
        return self.model.compute_logits(hidden.index_select(0, last_rows)).float()

    def _prompt_logprobs(
        self, seq: Sequence, hidden: Tensor, start: int
    ) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the tokens before it, from the prefill's hidden
        states (row start + i predicts prompt token i + 1); logits in chunks of rows."""
        ids = seq.prompt_token_ids
        k = seq.params.prompt_logprobs
        result: list[TokenLogprob | None] = [None]
        for first in range(0, len(ids) - 1, PROMPT_LOGPROBS_CHUNK):
            targets = ids[first + 1 : first + 1 + PROMPT_LOGPROBS_CHUNK]
            rows = hidden[start + first : start + first + len(targets)]
            logits = self.model.compute_logits(rows).float()
            result += token_logprobs(logits, targets, [k] * len(targets))
        return result

    def decode(self, seqs: list[Sequence]) -> Tensor:
        """One query token per sequence through ``decode_fn``; logits of the real rows."""
        positions = [seq.num_tokens - 1 for seq in seqs]
        width = width_bucket(max(len(seq.block_table) for seq in seqs))
        logits = self.decode_fn(
            self._tensor([seq.last_token_id for seq in seqs], torch.int64),
            self._tensor(positions, torch.int64),
            self._block_tables(seqs, width),
            self._tensor([seq.num_tokens for seq in seqs], torch.int32),
            self._tensor(
                [self._slot(s, p) for s, p in zip(seqs, positions, strict=True)], torch.int64
            ),
        )
        return logits[: len(seqs)].float()

    def eager_decode(
        self,
        input_ids_gpu: Tensor,
        positions_gpu: Tensor,
        block_tables_gpu: Tensor,
        seq_lens_gpu: Tensor,
        slot_mapping_gpu: Tensor,
    ) -> Tensor:
        """The default decode_fn: the model's eager forward and compute_logits."""
        num_seqs = input_ids_gpu.shape[0]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=slot_mapping_gpu,
            block_tables=block_tables_gpu,
            seq_lens=seq_lens_gpu,
            query_start_loc=torch.arange(
                num_seqs + 1, dtype=torch.int32, device=input_ids_gpu.device
            ),
        )
        with torch.no_grad():
            hidden = self.model(input_ids_gpu, positions_gpu, meta, self.kv)
            return self.model.compute_logits(hidden)

    def eager_prefill(
        self,
        input_ids_gpu: Tensor,
        positions_gpu: Tensor,
        meta: AttentionMetadata,
        splice: ImageSplice | None,
    ) -> Tensor:
        """The default prefill_fn: the model's eager forward, with image rows spliced in."""
        return eager_prefill(self.model, self.kv, input_ids_gpu, positions_gpu, meta, splice)

    def _slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _block_tables(self, seqs: list[Sequence], width: int) -> Tensor:
        # NOTE: padding points at the reserved dummy block, never at a live sequence's KV.
        pad = PagedKVStorage.DUMMY_BLOCK
        rows = [seq.block_table + [pad] * (width - len(seq.block_table)) for seq in seqs]
        return self._tensor(rows, torch.int32)

    def _tensor(self, values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


def _cumsum0(lengths: list[int]) -> list[int]:
    total = [0]
    for n in lengths:
        total.append(total[-1] + n)
    return total
