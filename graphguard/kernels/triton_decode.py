"""Paged decode attention in Triton: split-K (flash-decoding), GQA-aware, float32 accumulation.

Each program of the first kernel takes one row, one KV head and one split of the context: it
loads the group's query heads once, walks only the split's real tokens (up to the row's
length, never the padded width) through the block table, and keeps an online softmax. With one
split it writes the output directly; otherwise it writes a normalized partial and its
log-sum-exp, and a second kernel merges a row's partials, a chunk of splits at a time, in split
order. A split past the row's end does nothing at all, so a padding row costs its programs'
launch only.

NOTE: deterministic, and the same in any batch: the split plan (graphguard/kernels/
decode_plan.py) depends only on the table width and the KV heads, each split's tokens are
reduced in one fixed order, and the merge goes in split order. A graph's replay equals its
eager call bit for bit, and a row's output depends neither on the other rows' values nor on how
many share its batch (unpadded, padded to its bucket, or riding a larger bucket's graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphguard.kernels.decode_plan import SPLIT_RULE, SplitRule
from graphguard.kernels.launch import follow_previous, launch_flags


@triton.jit
def _attend_tile(
    q,
    first,
    end,
    table_ptr,
    k_head_ptr,
    v_head_ptr,
    lane_block,
    lane_offsets,
    scale,
    m,
    total,
    acc,
    ROW_STRIDE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of BLOCK_N context tokens from `first` (those before `end`) into the online
    softmax state (m, total, acc) of the group's query heads.

    `first` is a multiple of BLOCK_N, so with power-of-two blocks a tile's token i is in table
    entry first // BLOCK_SIZE + lane_block[i], at row first % BLOCK_SIZE + i % BLOCK_SIZE of
    that block: only the block ids and one scalar offset change from tile to tile."""
    valid = first + tl.arange(0, BLOCK_N) < end
    block = tl.load(table_ptr + first // BLOCK_SIZE + lane_block, mask=valid, other=0)
    row = block.to(tl.int64) * BLOCK_SIZE + first % BLOCK_SIZE
    offsets = (row * ROW_STRIDE)[:, None] + lane_offsets
    k = tl.load(k_head_ptr + offsets, mask=valid[:, None], other=0.0)
    v = tl.load(v_head_ptr + offsets, mask=valid[:, None], other=0.0)  # issued with k
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, total * alpha + tl.sum(p, axis=1), acc


# NOTE: the plan's integers are not specialized on: Triton compiles a kernel again for each
# class of an integer argument (1, a multiple of 16, any other), and every split count would
# otherwise find a cold kernel in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "split_tokens"])
def _partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    scale,
    stride_table,
    num_splits,
    split_tokens,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_STRIDE: tl.constexpr,  # one cache slot's elements: NUM_KV_HEADS * HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,  # the interpreter's trip count (split_tokens / BLOCK_N)
    DYNAMIC_LOOP: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)  # NOTE: before the early exit below (graphguard/kernels/launch.py)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_tokens
    # NOTE: a split past the row's end (a padding row's, or a short row's in a wide table)
    # loads and stores nothing: the merge reads only the splits that hold a token. A graph
    # ridden by fewer real rows than it has (the pad-up rule) launches many such programs.
    if (start < seq_len) | DIRECT:
        _attend_split(
            q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, part_out_ptr, part_lse_ptr, out_ptr,
            scale, stride_table, num_splits, split_tokens, seq, kv_head, split, start,
            tl.minimum(start + split_tokens, seq_len), GROUP, BLOCK_H, NUM_KV_HEADS, HEAD_DIM,
            ROW_STRIDE, BLOCK_SIZE, BLOCK_N, SPLIT_TILES, DYNAMIC_LOOP, DIRECT, PRECISION,
        )  # fmt: skip


@triton.jit
def _attend_split(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, part_out_ptr, part_lse_ptr, out_ptr, scale,
    stride_table, num_splits, split_tokens, seq, kv_head, split, start, end,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROW_STRIDE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program's split: tokens start .. end of row `seq`, KV head `kv_head`."""
    lane = tl.arange(0, BLOCK_H)
    is_head = lane < GROUP
    rows = seq * (NUM_KV_HEADS * GROUP) + kv_head * GROUP + lane  # [BLOCK_H] query heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=is_head[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    # Loop invariants of the tile walk: this head's K/V, each lane's table entry and offset.
    k_head_ptr = k_cache_ptr + kv_head * HEAD_DIM
    v_head_ptr = v_cache_ptr + kv_head * HEAD_DIM
    table_ptr = tables_ptr + seq * stride_table
    tile_lanes = tl.arange(0, BLOCK_N)
    lane_block = tile_lanes // BLOCK_SIZE
    lane_offsets = (tile_lanes % BLOCK_SIZE)[:, None] * ROW_STRIDE + dims[None, :]
    if DYNAMIC_LOOP:  # the device: a loop the compiler can pipeline
        for first in range(start, end, BLOCK_N):
            m, total, acc = _attend_tile(
                q, first, end, table_ptr, k_head_ptr, v_head_ptr, lane_block, lane_offsets,
                scale, m, total, acc, ROW_STRIDE, BLOCK_SIZE, BLOCK_N, PRECISION,
            )  # fmt: skip
    else:
        # NOTE: Triton's CPU interpreter cannot take a loop bound from a loaded value: a fixed
        # trip count (the split's tiles) with the tiles past the end skipped, same arithmetic.
        for tile in range(SPLIT_TILES):
            first = start + tile * BLOCK_N
            if first < end:
                m, total, acc = _attend_tile(
                    q, first, end, table_ptr, k_head_ptr, v_head_ptr, lane_block, lane_offsets,
                    scale, m, total, acc, ROW_STRIDE, BLOCK_SIZE, BLOCK_N, PRECISION,
                )  # fmt: skip
    # A padding row of length 0 (its one split writes the output directly) has total 0.
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    if DIRECT:
        dest = out_ptr + rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(dest, out.to(q.dtype), mask=is_head[:, None])
    else:
        part = rows * num_splits + split
        dest = part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(dest, out, mask=is_head[:, None])
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=is_head)


@triton.jit
def _merge_chunk(
    part_out_ptr, part_lse_ptr, first_part, first, num_used, dims, m, total, acc,
    CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Splits first .. first + CHUNK (those below `num_used`) of a row's head, whose partials
    start at `first_part`, into the running (m, total, acc): one load of their log-sum-exps and
    one of their partials, independent of the previous chunk's, so the loads of consecutive
    chunks overlap instead of waiting on each other."""
    splits = first + tl.arange(0, CHUNK)
    used = splits < num_used
    lse = tl.load(part_lse_ptr + first_part + splits, mask=used, other=float("-inf"))
    values = tl.load(
        part_out_ptr + (first_part + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=used[:, None], other=0.0,
    )  # fmt: skip
    # NOTE: a used split holds at least one token, so its lse (and m_new) is finite
    m_new = tl.maximum(m, tl.max(lse, axis=0))
    alpha = tl.exp(m - m_new)
    beta = tl.exp(lse - m_new)  # 0 for the chunk's unused splits
    acc = acc * alpha + tl.sum(values * beta[:, None], axis=0)
    return m_new, total * alpha + tl.sum(beta, axis=0), acc


@triton.jit(do_not_specialize=["num_splits", "split_tokens"])
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    split_tokens,
    num_splits,
    num_heads,
    NUM_CHUNKS: tl.constexpr,  # the interpreter's trip count (num_splits / CHUNK, rounded up)
    CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIMS: tl.constexpr,  # the dimensions of the head this program merges
    DYNAMIC_LOOP: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * num_heads + head
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = (seq_len + split_tokens - 1) // split_tokens
    first_part = row * num_splits
    # NOTE: a program of a head's share of the dimensions reads all of its log-sum-exps: each
    # computes the same weights, and the dimensions are independent of one another.
    dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([DIMS], tl.float32)
    # NOTE: chunks in split order, each reduced in one fixed order: the merge is deterministic
    if DYNAMIC_LOOP:
        for first in range(0, num_used, CHUNK):
            m, total, acc = _merge_chunk(
                part_out_ptr, part_lse_ptr, first_part, first, num_used, dims, m, total, acc,
                CHUNK, HEAD_DIM,
            )  # fmt: skip
    else:
        for chunk in range(NUM_CHUNKS):
            if chunk * CHUNK < num_used:
                m, total, acc = _merge_chunk(
                    part_out_ptr, part_lse_ptr, first_part, chunk * CHUNK, num_used, dims, m,
                    total, acc, CHUNK, HEAD_DIM,
                )  # fmt: skip
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


# Kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests) take the loop form
# it can run; the device takes the one it can pipeline.
_INTERPRETED = type(_partial_kernel).__name__ == "InterpretedFunction"


def decode_attention(
    q: Tensor,
    kv_cache: tuple[Tensor, Tensor],
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    rule: SplitRule = SPLIT_RULE,
) -> Tensor:
    """q ``[B, Hq, D]`` over the paged cache ``[num_blocks, block_size, Hkv, D]`` of each row's
    first ``seq_lens[b]`` tokens (block table ``[B, width]`` int32) -> ``[B, Hq, D]``.

    `rule` picks the split plan (graphguard/kernels/decode_plan.py; tests try others)."""
    k_cache, v_cache = kv_cache
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode attention needs a contiguous q and K/V cache")
    if num_heads % num_kv_heads or head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"unsupported heads {num_heads}/{num_kv_heads}, head_dim {head_dim}")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    plan = rule.plan(block_tables.shape[1] * block_size, num_kv_heads)
    part_out = part_lse = out
    if plan.num_splits > 1:
        part_out = q.new_empty((*q.shape[:2], plan.num_splits, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((*q.shape[:2], plan.num_splits), dtype=torch.float32)
    flags = launch_flags(q.device)
    _partial_kernel[(num_seqs, num_kv_heads, plan.num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out,
        scale, block_tables.stride(0), plan.num_splits, plan.split_tokens,
        GROUP=num_heads // num_kv_heads,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROW_STRIDE=num_kv_heads * head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=plan.block_n,
        # NOTE: on the device the split's length is a runtime value: one compile serves every
        # width (only the interpreter needs its trip count as a constant).
        SPLIT_TILES=plan.split_tokens // plan.block_n if _INTERPRETED else 1,
        DYNAMIC_LOOP=not _INTERPRETED, DIRECT=plan.num_splits == 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages, **flags,
    )  # fmt: skip
    if plan.num_splits > 1:
        merge_programs = max(1, min(plan.merge_programs, head_dim // 16))  # 16 dims or more
        _merge_kernel[(num_seqs, num_heads, merge_programs)](
            part_out, part_lse, seq_lens, out, plan.split_tokens, plan.num_splits, num_heads,
            NUM_CHUNKS=triton.cdiv(plan.num_splits, plan.merge_chunk) if _INTERPRETED else 1,
            CHUNK=plan.merge_chunk, HEAD_DIM=head_dim, DIMS=head_dim // merge_programs,
            DYNAMIC_LOOP=not _INTERPRETED, num_warps=2, **flags,
        )  # fmt: skip
    return out
