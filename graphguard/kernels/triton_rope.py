"""RoPE over fused q/k/v rows, with Qwen3's per-head q/k norm, and (in decode) the K/V cache
write, as one Triton kernel.

One program handles one head of one token: a q head is normalized (when the model norms q/k),
rotated and stored; a k head likewise, then stored with its v head either at the token's cache
slot (decode) or into k for the caller (prefill, whose attention writes the cache itself).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphguard.kernels.launch import follow_previous, launch_flags
from graphguard.kernels.reference import HeadShape, QKNorm


@triton.jit
def _normed(x, weight_ptr, dims, inv_rms):
    """The reference's per-head RMSNorm: normalized, cast back, then scaled and cast again."""
    weight = tl.load(weight_ptr + dims).to(tl.float32)
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
    return (weight * normed).to(x.dtype)


@triton.jit
def _rotated(row, norm_ptr, rope, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head at `row`: normalized by the weights at `norm_ptr` (HAS_NORM), then rotated by
    the token's cos/sin rows `rope` (the halves convention: x * cos + rotate_half(x) * sin)."""
    dims = tl.arange(0, HEAD_DIM)
    partner = (dims + HEAD_DIM // 2) % HEAD_DIM
    x = tl.load(row + dims)
    x_partner = tl.load(row + partner)
    if HAS_NORM:
        x32 = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / HEAD_DIM + eps)
        x_new = _normed(x, norm_ptr, dims, inv_rms)
        x_partner = _normed(x_partner, norm_ptr, partner, inv_rms)
        x = x_new
    cos = tl.load(rope[0] + dims).to(tl.float32)
    sin = tl.load(rope[1] + dims).to(tl.float32)
    sign = tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)
    return (x.to(tl.float32) * cos + sign * x_partner.to(tl.float32) * sin).to(x.dtype)


@triton.jit
def _rope_pair_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q,
    stride_k,
    stride_rope_row,
    stride_rope_token,
    length,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    at = (token // length) * stride_rope_row + (token % length) * stride_rope_token
    rope = (cos_ptr + at, sin_ptr + at)
    if head < NUM_HEADS:
        row = q_ptr + token * stride_q + head * HEAD_DIM
        rotated = _rotated(row, q_norm_ptr, rope, eps, HEAD_DIM, HAS_NORM)
        tl.store(q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + dims, rotated)
    else:
        kv_head = head - NUM_HEADS
        row = k_ptr + token * stride_k + kv_head * HEAD_DIM
        rotated = _rotated(row, k_norm_ptr, rope, eps, HEAD_DIM, HAS_NORM)
        tl.store(k_out_ptr + (token * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims, rotated)


@triton.jit
def _rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_rope,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    follow_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    rope = (cos_ptr + token * stride_rope, sin_ptr + token * stride_rope)
    if head < NUM_HEADS:
        rotated = _rotated(row, q_norm_ptr, rope, eps, HEAD_DIM, HAS_NORM)
    else:
        rotated = _rotated(row, k_norm_ptr, rope, eps, HEAD_DIM, HAS_NORM)
    dims = tl.arange(0, HEAD_DIM)
    if head < NUM_HEADS:
        tl.store(q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + dims, rotated)
    else:
        kv_head = head - NUM_HEADS
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + token).to(tl.int64)
            dest = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims
            v_row = qkv_ptr + token * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dest, rotated)
            tl.store(v_cache_ptr + dest, tl.load(v_row + dims))
        else:
            tl.store(k_out_ptr + (token * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims, rotated)


def _check(qkv: Tensor, cos: Tensor, heads: HeadShape) -> None:
    width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"expected fused q/k/v rows [T, {width}], got {tuple(qkv.shape)}")
    if heads.head_dim & (heads.head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {heads.head_dim}")
    if cos.shape != (qkv.shape[0], heads.head_dim) or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [T, {heads.head_dim}], got {tuple(cos.shape)}")


def _launch(
    qkv: Tensor,
    rope: tuple[Tensor, Tensor],
    heads: HeadShape,
    qk_norm: QKNorm | None,
    out: tuple[Tensor, Tensor],
    kv_cache: tuple[Tensor, Tensor],
    slots: Tensor | None,
) -> None:
    """q (and k, without a cache write) into `out`; k/v into `kv_cache` at `slots` if given."""
    (cos, sin), (q_out, k_out) = rope, out
    if not qkv.shape[0]:
        return
    norm = qk_norm or QKNorm(qkv, qkv, 0.0)  # unread without HAS_NORM
    grid = (qkv.shape[0], heads.num_heads + heads.num_kv_heads)
    _rope_kernel[grid](
        qkv, cos, sin, norm.q_weight, norm.k_weight,
        q_out, k_out, kv_cache[0], kv_cache[1], slots,
        qkv.stride(0), cos.stride(0), norm.eps,
        NUM_HEADS=heads.num_heads, NUM_KV_HEADS=heads.num_kv_heads, HEAD_DIM=heads.head_dim,
        HAS_NORM=qk_norm is not None, WRITE_CACHE=slots is not None,
        num_warps=1 if heads.head_dim <= 128 else 2, **launch_flags(qkv.device),
    )  # fmt: skip


def rope_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, heads: HeadShape, qk_norm: QKNorm | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused q/k/v rows -> q ``[T, Hq, D]``, k ``[T, Hkv, D]`` (normed, rotated), v (a view)."""
    _check(qkv, cos, heads)
    num_tokens, head_dim = qkv.shape[0], heads.head_dim
    q = torch.empty(num_tokens, heads.num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, heads.num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _launch(qkv, (cos, sin), heads, qk_norm, (q, k), (q, q), None)
    v_start = (heads.num_heads + heads.num_kv_heads) * head_dim
    v = qkv[:, v_start:].view(num_tokens, heads.num_kv_heads, head_dim)
    return q, k, v


def rope_qkv_write(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    heads: HeadShape,
    qk_norm: QKNorm | None,
    kv_cache: tuple[Tensor, Tensor],
    slot_mapping: Tensor,
) -> Tensor:
    """`rope_qkv` with k and v stored at their cache slots ``[num_blocks, block_size, Hkv, D]``
    (contiguous); returns q ``[T, Hq, D]``."""
    _check(qkv, cos, heads)
    k_cache, v_cache = kv_cache
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V cache must be contiguous")
    if k_cache.shape[-2:] != (heads.num_kv_heads, heads.head_dim):
        raise ValueError(f"cache heads {tuple(k_cache.shape[-2:])} do not match {heads}")
    q = qkv.new_empty((qkv.shape[0], heads.num_heads, heads.head_dim))
    _launch(qkv, (cos, sin), heads, qk_norm, (q, q), kv_cache, slot_mapping)
    return q


def rope_pair(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, qk_norm: QKNorm | None
) -> tuple[Tensor, Tensor]:
    """Separate q ``[B * L, Hq, D]`` and k ``[B * L, Hkv, D]`` rows (each token's heads
    contiguous) -> (q, k) normalized per head (with `qk_norm`) and rotated by the cos/sin tables
    ``[B or 1, L, D]`` (one table row per token; a batch of one shared by every row), new
    tensors of the same shapes: a model's own projections in, one kernel."""
    num_tokens, num_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if q.stride(1) != head_dim or k.stride(1) != head_dim or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rope_pair needs each token's heads contiguous")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    rows, length = (cos.shape[0], cos.shape[1]) if cos.dim() == 3 else (0, 0)
    fits = length > 0 and num_tokens % length == 0 and rows in (1, num_tokens // length)
    if not fits or cos.shape[2] != head_dim:
        raise ValueError(f"cos/sin must be [B or 1, L, {head_dim}], got {tuple(cos.shape)}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride() or sin.shape != cos.shape:
        raise ValueError("cos and sin must be alike, unit stride in their last dim")
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens:
        norm = qk_norm or QKNorm(q, q, 0.0)  # unread without HAS_NORM
        row_stride = cos.stride(0) if rows > 1 else 0
        _rope_pair_kernel[(num_tokens, num_heads + k.shape[1])](
            q, k, cos, sin, norm.q_weight, norm.k_weight, q_out, k_out,
            q.stride(0), k.stride(0), row_stride, cos.stride(1), length, norm.eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HEAD_DIM=head_dim,
            HAS_NORM=qk_norm is not None, num_warps=1 if head_dim <= 128 else 2,
            **launch_flags(q.device),
        )  # fmt: skip
    return q_out, k_out
