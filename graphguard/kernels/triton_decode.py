"""Paged decode attention in Triton: split-K (flash-decoding), GQA-aware, float32 accumulation.

Each program of the first kernel takes one sequence, one KV head and one split of the context:
it loads the group's query heads once, walks only the split's real tokens (up to the
sequence's length, never the padded width) through the block table, and keeps an online
softmax. With one split it writes the output directly; otherwise it writes a normalized partial
and its log-sum-exp, and a second kernel merges a sequence's partials in split order.

NOTE: deterministic for a given width: the split plan depends only on it, each split's tokens
are reduced in one fixed order, and the merge goes in split order, so a graph replay equals the
eager call bit for bit, and a row's output does not depend on the other rows of its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64  # context tokens per tile
# Context tokens per split: a 256-token context is one program per (sequence, KV head) that
# writes its output directly; longer ones split, so even a batch of one fills the device.
SPLIT_TOKENS = 256
MAX_SPLITS = 64


@triton.jit
def _attend_tile(
    q,
    first,
    end,
    table_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    scale,
    m,
    total,
    acc,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of BLOCK_N context tokens from `first` (those before `end`) into the online
    softmax state (m, total, acc) of the group's query heads."""
    tokens = first + tl.arange(0, BLOCK_N)
    valid = tokens < end
    block = tl.load(table_ptr + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = (block * BLOCK_SIZE + tokens % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
    offsets = slot[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0)  # issued with k
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, total * alpha + tl.sum(p, axis=1), acc


@triton.jit
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
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,  # the interpreter's trip count (split_tokens / BLOCK_N)
    DYNAMIC_LOOP: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    lane = tl.arange(0, BLOCK_H)
    is_head = lane < GROUP
    rows = seq * (NUM_KV_HEADS * GROUP) + kv_head * GROUP + lane  # [BLOCK_H] query heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=is_head[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    if DYNAMIC_LOOP:  # the device: a loop the compiler can pipeline
        for first in range(start, end, BLOCK_N):
            m, total, acc = _attend_tile(
                q, first, end, tables_ptr + seq * stride_table, k_cache_ptr, v_cache_ptr,
                kv_head, scale, m, total, acc,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION,
            )  # fmt: skip
    else:
        # NOTE: Triton's CPU interpreter cannot take a loop bound from a loaded value: a fixed
        # trip count (the split's tiles) with the tiles past the end skipped, same arithmetic.
        for tile in range(SPLIT_TILES):
            first = start + tile * BLOCK_N
            if first < end:
                m, total, acc = _attend_tile(
                    q, first, end, tables_ptr + seq * stride_table, k_cache_ptr, v_cache_ptr,
                    kv_head, scale, m, total, acc,
                    NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION,
                )  # fmt: skip
    # A split past the sequence's end (or a padding row of length 0) has total 0.
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
def _merge_split(
    part_out_ptr, part_lse_ptr, part, dims, one, m, total, acc, HEAD_DIM: tl.constexpr
):
    """Partial `part` (a sequence's head's split) into the running (m, total, acc)."""
    lse = tl.load(part_lse_ptr + part + one)
    value = tl.load(part_out_ptr + part * HEAD_DIM + dims)
    m_new = tl.maximum(m, lse)
    alpha = tl.exp(m - m_new)
    beta = tl.exp(lse - m_new)
    return m_new, total * alpha + beta, acc * alpha + value * beta


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    split_tokens,
    num_splits,
    num_heads,
    NUM_SPLITS: tl.constexpr,  # the interpreter's trip count (num_splits)
    HEAD_DIM: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * num_heads + head
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = (seq_len + split_tokens - 1) // split_tokens
    dims = tl.arange(0, HEAD_DIM)
    one = tl.zeros([1], tl.int32)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    # NOTE: in split order, so the merge is deterministic
    if DYNAMIC_LOOP:
        for split in range(0, num_used):
            m, total, acc = _merge_split(
                part_out_ptr, part_lse_ptr, row * num_splits + split, dims, one, m, total, acc,
                HEAD_DIM,
            )  # fmt: skip
    else:
        for split in range(NUM_SPLITS):
            if split < num_used:
                m, total, acc = _merge_split(
                    part_out_ptr, part_lse_ptr, row * num_splits + split, dims, one, m, total,
                    acc, HEAD_DIM,
                )  # fmt: skip
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


# Kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests) take the loop form
# it can run; the device takes the one it can pipeline.
_INTERPRETED = type(_partial_kernel).__name__ == "InterpretedFunction"


def plan_splits(ctx_tokens: int) -> tuple[int, int]:
    """(num_splits, split_tokens) for a context of `ctx_tokens` slots: splits of about
    SPLIT_TOKENS (at most MAX_SPLITS), each a whole number of BLOCK_N tiles.

    NOTE: a function of the width alone, not of the batch or the device, so a row's result
    does not depend on how many rows share its batch (a graph's padded batch computes each
    real row exactly as the unpadded eager call does).
    """
    splits = max(1, min(triton.cdiv(ctx_tokens, SPLIT_TOKENS), MAX_SPLITS))
    split_tokens = triton.cdiv(triton.cdiv(ctx_tokens, splits), BLOCK_N) * BLOCK_N
    return triton.cdiv(ctx_tokens, split_tokens), split_tokens


def decode_attention(
    q: Tensor,
    kv_cache: tuple[Tensor, Tensor],
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """q ``[B, Hq, D]`` over the paged cache ``[num_blocks, block_size, Hkv, D]`` of each row's
    first ``seq_lens[b]`` tokens (block table ``[B, width]`` int32) -> ``[B, Hq, D]``."""
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
    ctx_tokens = block_tables.shape[1] * block_size
    splits, split_tokens = plan_splits(ctx_tokens)
    group = num_heads // num_kv_heads
    part_out = part_lse = out
    if splits > 1:
        part_out = q.new_empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((num_seqs, num_heads, splits), dtype=torch.float32)
    _partial_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out,
        scale, block_tables.stride(0), splits, split_tokens,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        # NOTE: on the device the split's length is a runtime value: one compile serves every
        # width (only the interpreter needs its trip count as a constant).
        SPLIT_TILES=split_tokens // BLOCK_N if _INTERPRETED else 1,
        DYNAMIC_LOOP=not _INTERPRETED, DIRECT=splits == 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, seq_lens, out, split_tokens, splits, num_heads,
            NUM_SPLITS=splits if _INTERPRETED else 1, HEAD_DIM=head_dim,
            DYNAMIC_LOOP=not _INTERPRETED, num_warps=1,
        )  # fmt: skip
    return out
