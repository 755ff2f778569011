"""Paged prefill attention in Triton: varlen, causal, flash-style, GQA-aware, float32 softmax.

One launch attends every sequence of a packed prefill step. Its queries are packed ``q [T, Hq,
D]`` (sequence ``s`` owns rows ``query_start_loc[s]`` to ``query_start_loc[s + 1]``); its keys
and values are read in place from the paged cache through the block tables, the new tokens'
included (they are written to the cache before attention runs). Query ``i`` of a sequence sits
at absolute position ``seq_len - query_len + i`` and sees keys 0 up to that position, so a
chunk that continues a prefill attends over its cached prefix with no gather and no mask tensor.

A program takes one tile of a sequence's queries for every query head of one KV head: the
tile's ``BLOCK_M`` matrix rows are ``BLOCK_M // GROUP`` tokens times the group's query heads
(token-major), so each K/V tile is gathered through the block table once for the whole group
rather than once per query head, and the matrix unit gets full rows even when a group is small
or a chunk is a single token. It walks the keys in ``BLOCK_N`` tiles with an online softmax:
the few across the diagonal (masked), then those every query of the tile sees whole (no
mask); tiles past the tile's last query are never read, so causal attention costs about half
of dense.

Programs are numbered over all sequences' query tiles together (``T // BLOCK_Q + S`` of them,
a few past a sequence's end exit at once), each finds its sequence by a binary search of
``query_start_loc``: the grid depends on the step's shapes alone, never on host-side lengths.

NOTE: deterministic: each output row is reduced over its keys in one fixed order by one
program, with no atomics and no split of the keys, and the block sizes are a function of the
launch's shapes and the device (`pick_config`), so a graph replay equals the eager call bit for
bit; a sequence's output does not depend on the other sequences of its step unless they change
the tile size (only where a step's grid would leave most of the device idle).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634  # the softmax runs in base 2: exp(x) = exp2(x * log2(e))


class PrefillConfig(NamedTuple):
    """Block sizes and launch shape of one prefill attention launch."""

    block_m: int  # matrix rows per program: (block_m // group) tokens x the group's query heads
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# By head dimension: one fixed choice each (no autotuning, so results never depend on timing).
# 128 x 64 tiles are the Triton tutorial's forward choice on Hopper for D 64 and 128; D 256
# halves both to keep the float32 accumulator in registers.
CONFIGS = {
    64: PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    128: PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    256: PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
}
# Where those would leave most of the device idle (a short chunk over a long context: 50 new
# tokens are one tile per KV head), tiles of 16 rows: up to 8x the programs, each reading the
# same keys (from L2) for fewer queries.
SMALL_CONFIGS = {
    64: PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
    128: PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
    256: PrefillConfig(block_m=16, block_n=32, num_warps=8, num_stages=2),
}


class PrefillShape(NamedTuple):
    """What a launch's grid depends on."""

    num_tokens: int
    num_seqs: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int

    def block_m(self, config: PrefillConfig) -> int:
        """Matrix rows per program: at least one token's whole group."""
        return max(config.block_m, triton.next_power_of_2(self.group))

    def num_tiles(self, config: PrefillConfig) -> int:
        """Query tiles of all sequences (a sequence's last may be empty: it exits at once)."""
        return self.num_tokens // (self.block_m(config) // self.group) + self.num_seqs


def pick_config(shape: PrefillShape, num_sms: int = 0) -> PrefillConfig:
    """The block sizes for `shape`: CONFIGS for its head dimension (a power of two up to 256),
    or SMALL_CONFIGS where those would make fewer programs than half of `num_sms` (the
    device's multiprocessors; 0: never).

    NOTE: a function of the launch's shapes and the device: a call and its graph replay take
    the same tiles. A sequence's bits depend on its neighbours only where their tokens tip the
    choice (within tolerance, not bitwise)."""
    size = next(d for d in sorted(CONFIGS) if d >= shape.head_dim)
    if 2 * shape.num_tiles(CONFIGS[size]) * shape.num_kv_heads >= num_sms:
        return CONFIGS[size]
    return SMALL_CONFIGS[size]


@triton.jit
def _find_sequence(query_start_ptr, tile, num_seqs, steps, BLOCK_Q: tl.constexpr):
    """The sequence that owns query tile `tile`: sequence s owns tiles from
    ``query_start[s] // BLOCK_Q + s``, so the last s whose first tile is <= `tile`."""
    low = tile * 0
    size = num_seqs
    for _ in range(steps):
        half = size // 2
        middle = low + half
        first_tile = tl.load(query_start_ptr + middle) // BLOCK_Q + middle
        low = tl.where(first_tile <= tile, middle, low)
        size -= half
    return low


@triton.jit
def _attend_tile(
    q,
    keys_of,
    first,
    m,
    total,
    acc,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys `first` to `first + BLOCK_N` into the online softmax state (m, total, acc) of the
    tile's rows; MASKED: only keys before `key_end` and at or before each row's position.
    `keys_of`: (q_pos, key_end, table_ptr, width, k_cache_ptr, v_cache_ptr, kv_head, qk_scale),
    what every tile of a program reads."""
    q_pos, key_end, table_ptr, width, k_cache_ptr, v_cache_ptr, kv_head, qk_scale = keys_of
    keys = first + tl.arange(0, BLOCK_N)
    # NOTE: clamped to the table: a padding sequence may be longer than the table is wide
    # (its rows are never read), and no index may run past the table's end.
    entry = tl.minimum(keys // BLOCK_SIZE, width - 1)
    block = tl.load(table_ptr + entry).to(tl.int64)
    slot = (block * BLOCK_SIZE + keys % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
    offsets = slot[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        inside = keys < key_end
        k = tl.load(k_cache_ptr + offsets, mask=inside[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=inside[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + offsets)
        v = tl.load(v_cache_ptr + offsets)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & inside[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    # NOTE: the rescaled acc is the product's accumulator (not added after it), so on Hopper
    # the matrix unit accumulates in place and its instructions are not serialized.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, total * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _attend_range(
    q,
    keys_of,
    start,
    end,
    m,
    total,
    acc,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEY_TILES: tl.constexpr,  # the interpreter's trip count: the table's key tiles
    DYNAMIC_LOOP: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The key tiles from `start` (a multiple of BLOCK_N) up to `end`, in order."""
    if DYNAMIC_LOOP:  # the device: a loop the compiler can pipeline
        for first in range(start, end, BLOCK_N):
            m, total, acc = _attend_tile(
                q, keys_of, first, m, total, acc,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASKED, PRECISION,
            )  # fmt: skip
    else:
        # NOTE: Triton's CPU interpreter cannot take a loop bound from a loaded value: a fixed
        # trip count, the same tiles in the same order, the rest skipped.
        for index in range(KEY_TILES):
            first = index * BLOCK_N
            if (first >= start) & (first < end):
                m, total, acc = _attend_tile(
                    q, keys_of, first, m, total, acc,
                    NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASKED, PRECISION,
                )  # fmt: skip
    return m, total, acc


@triton.jit(do_not_specialize=["num_seqs", "search_steps", "num_tiles", "width"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    num_seqs,
    search_steps,
    num_tiles,
    stride_q,
    width,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # tokens per tile: BLOCK_M // GROUP
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # the interpreter's trip counts (search_steps, the key tiles)
    KEY_TILES: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # NOTE: the last tiles first: a sequence's later queries see more keys, and starting the
    # longest programs first leaves the short ones to fill the end of the launch.
    tile = num_tiles - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    if DYNAMIC_LOOP:
        seq = _find_sequence(query_start_ptr, tile, num_seqs, search_steps, BLOCK_Q)
    else:
        seq = _find_sequence(query_start_ptr, tile, num_seqs, SEARCH_STEPS, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    first_query = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q
    if first_query >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - query_len  # the absolute position of the sequence's first query
    rows = tl.arange(0, BLOCK_M)
    token = first_query + rows // GROUP
    is_real = (rows < BLOCK_Q * GROUP) & (token < query_len)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + token).to(tl.int64)
    q_offsets = q_rows[:, None] * stride_q + head[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=is_real[:, None], other=0.0)
    q_pos = ctx_start + token
    # Keys before full_end are seen by every query of the tile; none from key_end on is.
    full_end = (ctx_start + first_query) // BLOCK_N * BLOCK_N
    key_end = tl.minimum(seq_len, ctx_start + first_query + BLOCK_Q)
    table_ptr = tables_ptr + seq.to(tl.int64) * width
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # NOTE: the diagonal's tiles first, then the whole ones: in the other order ptxas
    # serialized the Hopper matrix instructions of the whole kernel (warning C7515) where the
    # accumulator passes from one loop to the next.
    keys = (q_pos, key_end, table_ptr, width, k_cache_ptr, v_cache_ptr, kv_head, qk_scale)
    m, total, acc = _attend_range(
        q, keys, full_end, key_end, m, total, acc,
        NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, KEY_TILES, DYNAMIC_LOOP, True, PRECISION,
    )  # fmt: skip
    m, total, acc = _attend_range(
        q, keys, 0, full_end, m, total, acc,
        NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, KEY_TILES, DYNAMIC_LOOP, False, PRECISION,
    )  # fmt: skip
    # Every row, padding rows too, sees key full_end (in the first tile): total > 0.
    out = acc / total[:, None]
    out_offsets = q_rows[:, None] * (NUM_KV_HEADS * GROUP * HEAD_DIM) + (
        head[:, None] * HEAD_DIM + dims[None, :]
    )
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=is_real[:, None])


# Kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests) take the loop form
# it can run; the device takes the one it can pipeline.
_INTERPRETED = type(_prefill_kernel).__name__ == "InterpretedFunction"


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor) -> None:
    """Raise for inputs the kernel does not take."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError("prefill attention needs each token's q heads contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("prefill attention needs contiguous K/V caches of one shape")
    if k_cache.shape[-1] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {tuple(q.shape[1:])} do not fit the cache's {num_kv_heads}")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= max(CONFIGS):
        raise ValueError(f"unsupported head_dim {head_dim}")
    if block_size & (block_size - 1) or q.dtype != k_cache.dtype:
        raise ValueError(f"unsupported block size {block_size} or dtypes {q.dtype}")
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        raise ValueError("block tables must be contiguous int32")


def prefill_attention(
    q: Tensor,
    kv_cache: tuple[Tensor, Tensor],
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    config: PrefillConfig | None = None,
) -> Tensor:
    """Causal attention of packed queries ``q [T, Hq, D]`` over the paged cache ``[num_blocks,
    block_size, Hkv, D]`` (K then V) -> ``[T, Hq, D]`` (contiguous).

    Sequence ``s`` owns query rows ``query_start_loc[s]`` to ``query_start_loc[s + 1]`` (int32,
    ``[S + 1]``, starting at 0 and ending at T) and attends over its first ``seq_lens[s]``
    cached tokens (int32 ``[S]``; at least its query rows, whose K/V are in the cache already)
    through row ``s`` of ``block_tables`` (int32 ``[S, width]``). `config` overrides the block
    sizes (benchmarks and tests); no host sync, so the call can be captured in a graph."""
    k_cache, v_cache = kv_cache
    _check(q, k_cache, v_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, width = block_tables.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = q.new_empty((num_tokens, num_heads, head_dim))
    if num_tokens == 0 or num_seqs == 0:
        return out
    shape = PrefillShape(num_tokens, num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 0
    config = config or pick_config(shape, num_sms)
    group, block_m = shape.group, shape.block_m(config)
    num_tiles = shape.num_tiles(config)
    search_steps = (num_seqs - 1).bit_length()
    _prefill_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, num_seqs, search_steps, num_tiles, q.stride(0), width,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=config.block_n,
        # NOTE: on the device the loops' bounds are runtime values: one compile serves every
        # step (only the interpreter needs its trip counts as constants).
        SEARCH_STEPS=search_steps if _INTERPRETED else 1,
        KEY_TILES=triton.cdiv(width * block_size, config.block_n) if _INTERPRETED else 1,
        DYNAMIC_LOOP=not _INTERPRETED,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def compile_tiles(num_heads: int, kv_cache: tuple[Tensor, Tensor]) -> None:
    """Compile the kernel for `num_heads` query heads over `kv_cache` with both tile sets (a
    launch of each over the cache's first block, read only): which set a step takes depends on
    its grid, so a warm-up's prefill alone would leave one to compile during serving."""
    k_cache = kv_cache[0]
    block_size, _, head_dim = k_cache.shape[1:]
    size = next(d for d in sorted(CONFIGS) if d >= head_dim)

    def ints(*values: int) -> Tensor:  # fresh tensors: aligned as the engine's are
        return torch.tensor([values], dtype=torch.int32, device=k_cache.device)

    q = k_cache.new_zeros((block_size, num_heads, head_dim))
    for configs in (CONFIGS, SMALL_CONFIGS):
        table, starts, lens = ints(0), ints(0, block_size)[0], ints(block_size)[0]
        prefill_attention(q, kv_cache, starts, lens, table, 1.0, configs[size])
