"""Turns a scheduled batch into model inputs and logits.

Each step's rows go to a graph runner of the engine's graphs (graphguard/engine/graphs) when
graphs are on, else to the eager forward of the same signature (graphguard/engine/models/
forward.py): one visible branch per kind of step. A runner replays a graph, or runs the same
eager forward with one named reason.

- Decode rows: one query token per sequence; the batch pads up to its batch bucket and the block
  tables to a width (engine/shapes.py), so few shapes recur.
- A short prefill without images runs as rows (shapes.py `prefills_as_rows`): each token a row
  of decode attention over its sequence's context, padded like a decode batch.
- Any other prefill runs as one packed call over the tokens of all prefilling sequences, image
  rows spliced in, padded up to a token bucket when prefill graphs are asked for (and, where
  the kernel set's attention joins the graph, its sequences and table width to buckets too).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from graphguard.engine.graphs.component import EngineGraphs
from graphguard.engine.models.attention import (
    AttentionMetadata,
    PrefillGroup,
    plan_prefill_groups,
)
from graphguard.engine.models.forward import (
    EagerForward,
    ImageSplice,
    PrefillContext,
    image_splice,
    prefill_inputs,
)
from graphguard.engine.scheduling.batch import ScheduledBatch
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.scheduling.sequence import Sequence
from graphguard.engine.shapes import (
    DECODE_PAD,
    prefill_seq_bucket,
    prefill_token_bucket,
    prefills_as_rows,
    row_bucket,
    whole_prefill,
    width_bucket,
)
from graphguard.engine.step.decode_inputs import DecodeInputs
from graphguard.engine.tokens.sampling import token_logprobs

# Rows of prompt logits computed at once for prompt logprobs (bounds rows x vocab floats).
PROMPT_LOGPROBS_CHUNK = 256


class ModelRunner:
    """Prepares AttentionMetadata for scheduled sequences and runs the model."""

    def __init__(
        self,
        forward: EagerForward,
        device: torch.device,
        *,
        graphs: EngineGraphs | None = None,
        pad_prefills: bool = False,
    ) -> None:
        self.forward = forward
        self.model = forward.model
        self.kv = forward.kv
        self.device = device
        self.block_size = forward.kv.block_size
        self.graphs = graphs  # None: every step runs the eager forward
        # NOTE: pad a packed prefill to a token bucket (graphed prefill is keyed by its token
        # count, so keys recur). Padding follows the setting, not whether graphs could be
        # built, so an engine computes the same tokens with graphs on, off or still earned.
        self.pad_prefills = pad_prefills
        self.decode_inputs = DecodeInputs(device)
        self.row_inputs = DecodeInputs(device)  # a prefill's as rows (its views live apart)
        self.packed_inputs = DecodeInputs(device)  # a packed prefill's

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> Tensor:
        """Logits [len(batch.seqs), vocab] float32, rows in ``batch.seqs`` order."""
        parts = []
        if batch.decodes:
            parts.append(self.decode(batch.decodes))
        if batch.prefills:
            parts.append(self.prefill(batch.prefill_seqs, batch.chunks))
        # batch.seqs is decodes then prefills, so concatenation restores request order.
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def prefill(self, seqs: list[Sequence], chunks: list[int] | None = None) -> Tensor:
        """One forward over the packed next `chunks` uncached tokens of each sequence (default:
        all of them), after its cached ones; logits of each chunk's last token."""
        if chunks is None:
            chunks = [seq.num_tokens - seq.num_cached_tokens for seq in seqs]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, chunk in zip(seqs, chunks, strict=True):
            first = seq.num_cached_tokens
            new_positions = range(first, first + chunk)
            input_ids += seq.token_ids[first : first + chunk]
            positions += new_positions
            slots += [self._slot(seq, pos) for pos in new_positions]
        seq_lens = [seq.num_cached_tokens + chunk for seq, chunk in zip(seqs, chunks, strict=True)]
        splice = image_splice(seqs, self.device, chunks)
        num_tokens = len(input_ids)
        rows = row_bucket(num_tokens)
        if splice is None and prefills_as_rows(self.model.kernels, rows, max(seq_lens)):
            pad_to = rows if self.pad_prefills else num_tokens
            hidden = self._prefill_rows(seqs, chunks, input_ids, positions, slots, pad_to)
            return self._logits(seqs, chunks, hidden, _cumsum0(chunks)[1:])
        # a whole graph where the kernel set allows one and the step is launch-bound
        whole = self.pad_prefills and whole_prefill(
            self.model.kernels, prefill_token_bucket(num_tokens)
        )
        ids_gpu, positions_gpu, meta = self._packed_meta(
            seqs, chunks, input_ids, positions, slots, whole
        )
        hidden = self._run_packed(ids_gpu, positions_gpu, meta, splice, whole)
        # the real sequences' rows, not the padding
        return self._logits(seqs, chunks, hidden, _cumsum0(chunks)[1:])

    def _packed_meta(
        self,
        seqs: list[Sequence],
        chunks: list[int],
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        whole: bool = False,
    ) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """The token ids, positions and metadata of a packed prefill on the device (one copy),
        padded (in place: `input_ids`, `positions`, `slots`) up to its token bucket when
        prefills pad, and for a `whole` graph its sequences and table width to buckets too."""
        num_tokens = len(input_ids)
        seq_lens = [seq.num_cached_tokens + chunk for seq, chunk in zip(seqs, chunks, strict=True)]
        query_lens = list(chunks)
        width = max(len(seq.block_table) for seq in seqs)
        # a whole graph is keyed by the tables' shape too: sequences and width padded
        width = width_bucket(width) if whole else width
        pad = prefill_token_bucket(num_tokens) - num_tokens if self.pad_prefills else 0
        dummy = PagedKVStorage.DUMMY_BLOCK
        if pad > 0:
            # NOTE: the padding is one more fresh sequence whose K/V go to the dummy block: it
            # attends only over itself, and no real row reads the dummy block.
            input_ids += [0] * pad
            positions += range(pad)
            slots += [dummy * self.block_size + i % self.block_size for i in range(pad)]
            seq_lens.append(pad)
            query_lens.append(pad)
        if whole:
            # empty sequences (no query, no context) up to the bucket: their attention
            # programs exit at once (graphguard/kernels/triton_prefill.py)
            empty = prefill_seq_bucket(len(seq_lens)) - len(seq_lens)
            seq_lens += [0] * empty
            query_lens += [0] * empty
        # the padding sequence's and the empty ones' tables are the dummy block's
        tables = np.full((len(seq_lens), width), dummy, dtype=np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        query_start_loc = _cumsum0(query_lens)
        ids_gpu, positions_gpu, slots_gpu, tables_gpu, lens_gpu, starts_gpu = (
            self.packed_inputs.pack_arrays(
                [(input_ids, np.int64), (positions, np.int64), (slots, np.int64),
                 (tables, np.int32), (seq_lens, np.int32), (query_start_loc, np.int32)]
            )
        )  # fmt: skip
        meta = AttentionMetadata(
            packed=True,
            slot_mapping=slots_gpu,
            block_tables=tables_gpu,
            seq_lens=lens_gpu,
            query_start_loc=starts_gpu,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
            prefill_groups=self._prefill_groups(query_lens, seq_lens),
        )
        return ids_gpu, positions_gpu, meta

    def _prefill_groups(
        self, query_lens: list[int], seq_lens: list[int]
    ) -> tuple[PrefillGroup, ...] | None:
        """The step's prefill groups, planned once here for the kernel set that reads them
        (None for one whose prefill attention takes every sequence in one launch)."""
        if not self.model.kernels.needs_prefill_groups:
            return None
        return plan_prefill_groups(query_lens, seq_lens, self.device)

    def _prefill_rows(
        self,
        seqs: list[Sequence],
        chunks: list[int],
        ids: list[int],
        positions: list[int],
        slots: list[int],
        bucket: int,
    ) -> Tensor:
        """Hidden states of a prefill run as rows (forward.py `prefills_as_rows`): each token
        attends over its sequence's paged context up to its own position, padded up to
        `bucket` rows that read and write only the dummy block."""
        width = width_bucket(max(len(seq.block_table) for seq in seqs))
        tables: list[list[int]] = []
        for seq, chunk in zip(seqs, chunks, strict=True):
            tables += [_padded_table(seq.block_table, width)] * chunk
        ids_gpu, positions_gpu, tables_gpu, lens_gpu, slots_gpu = _pack_rows(
            self.row_inputs, bucket, ids, positions, slots, tables
        )
        args = (ids_gpu, positions_gpu, tables_gpu, lens_gpu, slots_gpu)
        rows = self.graphs.prefill_rows if self.graphs is not None else None
        if rows is None:
            return self.forward.rows(*args)
        return rows(*args)  # a replay, or the same eager rows with one named reason

    def _run_packed(
        self,
        ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        splice: ImageSplice | None,
        whole: bool,
    ) -> Tensor:
        """Hidden states of a packed prefill: through its `whole` graph (where it has none
        yet, the whole runner answers by the segments), through the segment graphs, or
        eagerly."""
        graphs = self.graphs
        if graphs is None or graphs.prefill is None:
            return self.forward.prefill(ids, positions, meta, splice)
        context = PrefillContext(meta, self.kv)
        if whole and graphs.prefill_whole is not None:
            carry = prefill_inputs(self.model, ids, positions, splice, meta, whole=True)
            return graphs.prefill_whole(carry, context)[0]
        carry = prefill_inputs(self.model, ids, positions, splice, meta)
        return graphs.prefill(carry, context)[0]

    def _logits(
        self, seqs: list[Sequence], chunks: list[int], hidden: Tensor, ends: list[int]
    ) -> Tensor:
        """The logits of each sequence's last prefilled row (its chunk ends at row `ends[i]`),
        prompt logprobs recorded on the way for those that asked."""
        for seq, end, chunk in zip(seqs, ends, chunks, strict=True):
            if seq.params.prompt_logprobs is not None and not seq.has_prompt_logprobs:
                self._add_prompt_logprobs(seq, hidden[end - chunk : end])
        last_rows = self._tensor([end - 1 for end in ends], torch.int64)
        return self.model.compute_logits(hidden.index_select(0, last_rows)).float()

    def _add_prompt_logprobs(self, seq: Sequence, hidden: Tensor) -> None:
        """Extend `seq.prompt_logprobs` with what this prefill chunk scores: the hidden row at
        position p predicts prompt token p + 1 (rows of at most PROMPT_LOGPROBS_CHUNK at a
        time). The first prompt token, with no context, gets None."""
        ids = seq.prompt_token_ids
        first = seq.num_cached_tokens
        scored = seq.prompt_logprobs = [None] if first == 0 else seq.prompt_logprobs or [None]
        k = seq.params.prompt_logprobs
        end = min(first + hidden.shape[0], len(ids) - 1)  # positions whose next token is prompt
        for pos in range(first, end, PROMPT_LOGPROBS_CHUNK):
            targets = ids[pos + 1 : min(pos + 1 + PROMPT_LOGPROBS_CHUNK, end + 1)]
            rows = hidden[pos - first : pos - first + len(targets)]
            logits = self.model.compute_logits(rows).float()
            scored += token_logprobs(logits, targets, [k] * len(targets))

    def decode(self, seqs: list[Sequence], ahead_ids: Tensor | None = None) -> Tensor:
        """One query token per sequence, through the decode graphs or eagerly; real rows' logits.

        With ``ahead_ids`` (each row's next token, on the device, not appended yet) it is the
        step after that: every sequence one position on (graphguard/engine/step/overlap.py)."""
        shift = 0 if ahead_ids is None else 1
        positions = [seq.num_tokens - 1 + shift for seq in seqs]
        width = width_bucket(max(len(seq.block_table) for seq in seqs))
        pad_id = DECODE_PAD[0]
        ids = [seq.last_token_id for seq in seqs] if ahead_ids is None else [pad_id] * len(seqs)
        slots = [self._slot(s, p) for s, p in zip(seqs, positions, strict=True)]
        tables = [_padded_table(seq.block_table, width) for seq in seqs]
        graphs = self.graphs
        rows = graphs.decode_rows(len(seqs)) if graphs is not None else len(seqs)
        inputs = _pack_rows(self.decode_inputs, rows, ids, positions, slots, tables)
        if ahead_ids is not None:
            # on the device, ordered after the step that sampled them
            inputs[0][: len(seqs)].copy_(ahead_ids)
        if graphs is None:
            logits = self.forward.decode(*inputs)
        else:
            logits = graphs.decode(*inputs)  # a replay, or the same eager decode with one reason
        return logits[: len(seqs)].float()

    def _slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _tensor(self, values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


def _padded_table(table: list[int], width: int) -> list[int]:
    """A block table padded to `width` blocks with the dummy block (padding never points at a
    live sequence's KV)."""
    return table + [DECODE_PAD[2]] * (width - len(table))


def _pack_rows(
    inputs: DecodeInputs,
    rows: int,
    ids: list[int],
    positions: list[int],
    slots: list[int],
    tables: list[list[int]],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """decode's arguments for rows that each attend over their context up to their own
    position (a decode batch, or a prefill run as rows), packed in one copy and padded up to
    `rows` rows.

    NOTE: the padding rows (DECODE_PAD) read and write only the dummy block."""
    lens = [position + 1 for position in positions]
    pad = rows - len(ids)
    if pad > 0:
        pad_id, pad_position, pad_block, pad_len, pad_slot = DECODE_PAD
        ids, positions = ids + [pad_id] * pad, positions + [pad_position] * pad
        lens, slots = lens + [pad_len] * pad, slots + [pad_slot] * pad
        tables = tables + [[pad_block] * len(tables[0])] * pad
    return inputs.pack(ids, positions, slots, tables, lens)


def _cumsum0(lengths: list[int]) -> list[int]:
    total = [0]
    for n in lengths:
        total.append(total[-1] + n)
    return total
