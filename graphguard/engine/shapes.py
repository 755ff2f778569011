"""Every shape the engine pads a step to, in one vocabulary.

Graphs are keyed by shapes, so a step is padded up to a few recurring ones:

- a **decode batch** pads its rows to a batch bucket (GraphConfig.batch_buckets) and its block
  tables to a **width**: a power of two of blocks, at least MIN_WIDTH_BLOCKS;
- a **prefill run as rows** (`prefills_as_rows`: each token one row of decode attention over its
  sequence's context, as a decode batch is) pads its tokens to a **row bucket**, a power of two;
- a **packed prefill** (varlen attention over packed sequences, the segmented pipeline) pads its
  tokens to a **token bucket** (`prefill_token_bucket`); where its attention is in the graph
  too (a kernel set's `whole_prefill_graphs`), its sequences to a **sequence bucket**
  (`prefill_seq_bucket`, with empty sequences) and its block tables to a width.

Padding rows read and write only the reserved dummy KV block (`DECODE_PAD`). The pad-up rule
of the graph runtime (a call may ride a larger admitted bucket, up to a pad factor) and the
ladders of keys a lazy start captures are graphguard.core.keys' `pad_ladder`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from graphguard.engine.config import DEFAULT_MAX_MODEL_LEN
from graphguard.engine.scheduling.kv import PagedKVStorage

if TYPE_CHECKING:
    from graphguard.engine.config import EngineConfig
    from graphguard.kernels.reference import TorchKernels

# Pad values of a row's arguments, by position (ids, positions, block table, sequence length,
# slot): token 0, position 0, the dummy block, length 1 (a non-empty softmax), a slot inside
# the dummy block.
DECODE_PAD = (0, 0, PagedKVStorage.DUMMY_BLOCK, 1, PagedKVStorage.DUMMY_BLOCK)

# The narrowest padded block table of a decode batch. Short sequences share one width instead of
# earning a graph at 1, 2 and 4 blocks as they grow (the fused decode attention walks only a
# sequence's real tokens, so a wider table costs it nothing; the reference one reads it all).
MIN_WIDTH_BLOCKS = 8

MIN_PREFILL_TOKENS = 16  # the smallest token bucket of a prefill, packed or as rows
# Up to this many tokens, a packed prefill pads to the next power of two (`prefill_token_bucket`).
POWER_OF_TWO_PREFILL_TOKENS = 512
# The largest prefill that runs as rows (`prefills_as_rows`), and its row buckets: the powers of
# two from MIN_PREFILL_TOKENS up to it.
ROW_PREFILL_TOKENS = 2048
ROW_BUCKETS = tuple(
    1 << i for i in range(MIN_PREFILL_TOKENS.bit_length() - 1, ROW_PREFILL_TOKENS.bit_length())
)


def width_bucket(num_blocks: int) -> int:
    """The power of two >= num_blocks (at least MIN_WIDTH_BLOCKS): the padded block-table
    width of a batch of rows."""
    return max(MIN_WIDTH_BLOCKS, 1 << max(0, num_blocks - 1).bit_length())


def row_bucket(num_tokens: int) -> int:
    """The rows a prefill of `num_tokens` run as rows is padded to with graphs on: the next
    power of two, at least MIN_PREFILL_TOKENS (a padding row costs a row of GEMMs and attends
    over one slot of the dummy block)."""
    return max(MIN_PREFILL_TOKENS, 1 << (num_tokens - 1).bit_length())


def prefill_token_bucket(num_tokens: int) -> int:
    """The token count a packed prefill of `num_tokens` is padded up to, so that prefill graphs
    keyed by token count recur under real traffic: the next power of two (at least 16) up to
    POWER_OF_TWO_PREFILL_TOKENS, where a step's cost is its launches, not its rows, and a wave
    of prompts split over two steps still lands on few keys; above it a multiple of a quarter
    of the power of two below (128 for 512-1023, 256 for 1024-2047, ...), padding under 25%."""
    if num_tokens <= POWER_OF_TWO_PREFILL_TOKENS:
        return max(MIN_PREFILL_TOKENS, 1 << (num_tokens - 1).bit_length())
    step = 1 << (num_tokens.bit_length() - 3)
    return -(-num_tokens // step) * step


# The most packed tokens (padded) a whole prefill graph takes (`whole_prefill`): the steps whose
# cost is their launches. Above it a step's rows dominate, the segments' host work hides behind
# the device's, and a capture (three forwards of that many tokens) would rarely pay back.
WHOLE_PREFILL_TOKENS = POWER_OF_TWO_PREFILL_TOKENS


def whole_prefill(kernels: TorchKernels, padded_tokens: int) -> bool:
    """Whether a packed prefill of `padded_tokens` (its token bucket) runs as a whole graph:
    the kernel set's attention reads only device tensors (`whole_prefill_graphs`) and the step
    is at most WHOLE_PREFILL_TOKENS."""
    return kernels.whole_prefill_graphs and padded_tokens <= WHOLE_PREFILL_TOKENS


def prefill_seq_bucket(num_seqs: int) -> int:
    """The sequences a packed prefill whose attention is in its graph is padded to, its
    tokens' padding sequence included: 2 (one prompt and its padding), then 8, 32, 128, ...
    (a power of four apart: a wave of 15 questions and one of 17 share a key). An empty
    sequence costs its attention a program that returns at once, and a row of the tables."""
    bucket = 2
    while bucket < num_seqs:
        bucket *= 4
    return bucket


def wave_seq_buckets(max_rows: int) -> list[int]:
    """The sequence buckets of a wave of continued chunks (short questions after cached
    contexts) of up to `max_rows` sequences and its padding sequence: from 8 up to the bucket
    of `max_rows` + 1 (8 and 32 for 16 rows). A start captures the whole prefill graphs of
    the continued group at each (graphs/component.py)."""
    top, buckets = prefill_seq_bucket(max_rows + 1), [8]
    while buckets[-1] < top:
        buckets.append(4 * buckets[-1])
    return buckets


def prefills_as_rows(kernels: TorchKernels, num_tokens: int, longest_context: int) -> bool:
    """Whether a prefill of `num_tokens` tokens (padding included), none of whose sequences
    attends over more than `longest_context` tokens, runs as rows: each token one row of decode
    attention over its sequence's paged context up to its own position.

    NOTE: the whole prefill is then one kernel sequence whose shapes depend only on (tokens,
    table width): eagerly about as many launches as a decode step, and capturable as one graph
    (graphguard/engine/graphs/runners.py). Each row reads its whole context, so rows are kept to
    prefills of short sequences: at most ROW_PREFILL_TOKENS tokens and the kernel set's
    `row_prefill_area` (tokens x longest context; 0 where the set's decode attention gathers
    the context, as the reference does)."""
    area = num_tokens * longest_context
    return num_tokens <= ROW_PREFILL_TOKENS and 0 < area <= kernels.row_prefill_area


def row_widths(
    kernels: TorchKernels, block_size: int, num_tokens: int, widths: Sequence[int]
) -> list[int]:
    """The table widths of `widths` at which a prefill of `num_tokens` tokens can run as rows:
    those whose shortest context (the fewest tokens that need the width) keeps the prefill
    within the kernel set's row area. A fresh prompt's rows stay at its own width; a chunk
    that continues over a cached context (a question after a long document, a chat turn after
    its history) runs at the context's. With the fused set, 32 tokens run as rows at every
    width up to 32k-token contexts, 256 up to 4k, 2,048 up to 512; none where the kernel set
    runs no prefill as rows."""
    if kernels.row_prefill_area <= 0:
        return []
    found = []
    for width in widths:
        shortest = 1 if width <= MIN_WIDTH_BLOCKS else (width // 2) * block_size + 1
        if prefills_as_rows(kernels, num_tokens, shortest):
            found.append(width)
    return found


def continued_prefill_group(
    kernels: TorchKernels, block_size: int, widths: Sequence[int], largest_bucket: int
) -> int | None:
    """The packed prefill's token bucket that a lazy start captures as a group of segments
    (graphs/component.py `_price_captures`): POWER_OF_TWO_PREFILL_TOKENS, the largest bucket
    whose step is launch-bound, where a wave of short chunks over long cached contexts (many
    clients' questions after one document) lands once it is too large to run as rows. None
    where the kernel set runs no prefill as rows (every prefill is packed, and the smallest
    group prices them), where no step's prefill reaches that bucket (`largest_bucket`: the
    largest of warmup_prefill_tokens), or where so many tokens run as rows at every width of
    `widths` (short contexts)."""
    tokens = POWER_OF_TWO_PREFILL_TOKENS
    if kernels.row_prefill_area <= 0 or largest_bucket < tokens:
        return None
    widest = max(widths)
    return None if row_widths(kernels, block_size, tokens, [widest]) else tokens


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
    length = max_model_len or config.max_model_len or DEFAULT_MAX_MODEL_LEN
    max_width = width_bucket(-(-length // config.block_size))
    widths = [1 << i for i in range(max_width.bit_length()) if 1 << i >= MIN_WIDTH_BLOCKS]
    return [b for b in buckets if b <= cap], widths


def warmup_prefill_tokens(max_num_batched_tokens: int) -> list[int]:
    """The prefill token buckets a warm start captures: the powers of two from 16 up to the
    one that holds a step's token budget, at most ROW_PREFILL_TOKENS (the buckets that small
    prompts, and waves of them, land on; larger keys are earned by traffic). Prefills run as
    rows take them all; segmented groups those up to POWER_OF_TWO_PREFILL_TOKENS."""
    top = min(ROW_PREFILL_TOKENS, row_bucket(max_num_batched_tokens))
    first = MIN_PREFILL_TOKENS.bit_length() - 1
    return [1 << i for i in range(first, top.bit_length())]  # top is a power of two
