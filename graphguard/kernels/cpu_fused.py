"""Fused CPU kernels (Numba) for the 4-bit decode step: a layer's norms, RoPE with the KV
write, attention and SiLU-and-multiply, each one compiled loop instead of 5-12 PyTorch ops.

On a 2-core CPU a PyTorch op over one token's row costs 2-5 us of dispatch whatever it
computes; the 4-bit decode step of the embedded model spent about 9 of its 16 ms in the 35-40
small ops of each of its 30 layers, next to 6.5 ms in the GEMMs. Numba compiles these loops
for the CPU it runs on (cached on disk after the first start); a call costs about 1 us plus
0.7 us for each tensor handed to it (`Tensor.numpy()` is a view, not a copy).

Each kernel computes what its reference in graphguard/kernels/reference.py computes, in
float32, row by row (so a row's result does not depend on the batch around it), with sums in
an order fixed by the instruction set (see _jit). A bfloat16 tensor (what the 4-bit GEMMs read
and write) is handed over as its int16 bits: read by shifting them up, written rounded to
nearest even.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from torch import Tensor

# NOTE: reassociation lets the dot products and sums vectorize; a sum's order then follows the
# CPU's vector width, so two instruction sets differ in the last bits (as PyTorch's own
# kernels do) while one machine always repeats itself.
_jit = njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})


@_jit
def _bf16_to_f32(bits, out):
    """int16 bfloat16 bits [n] -> float32 [n] (out)."""
    wide = out.view(np.uint32)
    for i in range(bits.shape[0]):
        wide[i] = np.uint32(np.uint16(bits[i])) << 16


@_jit
def _f32_to_bf16(values, bits):
    """float32 [n] -> int16 bfloat16 bits [n], rounded to nearest even (as Tensor.to)."""
    wide = values.view(np.uint32)
    for i in range(values.shape[0]):
        u = wide[i]
        if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN stays NaN
            bits[i] = np.int16(np.uint16((u >> 16) | 0x40))
        else:
            bits[i] = np.int16(np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16))


@_jit
def _rms_norm_in_place(x, weight, eps):
    """x = rms_norm(x) * weight for one float32 row (a hidden row, or one head's for Qwen3's
    q/k norm)."""
    total = np.float32(0.0)
    for i in range(x.shape[0]):
        total += x[i] * x[i]
    inv = np.float32(1.0) / np.sqrt(total / np.float32(x.shape[0]) + np.float32(eps))
    for i in range(x.shape[0]):
        x[i] = weight[i] * (x[i] * inv)


@_jit
def _add_rms_norm_rows(x_bits, residual, weight, eps, h_out, normed_bits):
    """h = bf16(x) + residual; normed = bf16(rms_norm(h) * weight), per row."""
    rows, dim = residual.shape
    normed = np.empty(dim, np.float32)
    for r in range(rows):
        _bf16_to_f32(x_bits[r], normed)
        for i in range(dim):
            h_out[r, i] = normed[i] + residual[r, i]
            normed[i] = h_out[r, i]
        _rms_norm_in_place(normed, weight, eps)
        _f32_to_bf16(normed, normed_bits[r])


@_jit
def _rms_norm_rows(x, weight, eps, normed_bits):
    """normed = bf16(rms_norm(x) * weight) for float32 x, per row."""
    rows, dim = x.shape
    normed = np.empty(dim, np.float32)
    for r in range(rows):
        normed[:] = x[r]
        _rms_norm_in_place(normed, weight, eps)
        _f32_to_bf16(normed, normed_bits[r])


@_jit
def _silu_mul_rows(gate_up_bits, out_bits):
    """bf16(silu(gate) * up) per row of bf16 [gate | up]."""
    rows, width = gate_up_bits.shape
    inner = width // 2
    both = np.empty(width, np.float32)
    out = np.empty(inner, np.float32)
    for r in range(rows):
        _bf16_to_f32(gate_up_bits[r], both)
        for i in range(inner):
            gate = both[i]
            out[i] = gate / (np.float32(1.0) + np.exp(-gate)) * both[inner + i]
        _f32_to_bf16(out, out_bits[r])


@_jit
def _rope_write_rows(
    qkv_bits, cos, sin, num_heads, num_kv_heads, q_weight, k_weight, eps, use_qk_norm,
    k_cache, v_cache, slots, q_out,
):  # fmt: skip
    """Per row: q/k (normed when asked) rotated by RoPE (half-split layout); k and v written
    to their cache slot ``[slots, Hkv, D]``; q to q_out ``[rows, Hq, D]``."""
    rows = qkv_bits.shape[0]
    head_dim = cos.shape[1]
    half = head_dim // 2
    row = np.empty(qkv_bits.shape[1], np.float32)
    head = np.empty(head_dim, np.float32)
    for r in range(rows):
        _bf16_to_f32(qkv_bits[r], row)
        slot = slots[r]
        for h in range(num_heads + num_kv_heads):
            for i in range(head_dim):
                head[i] = row[h * head_dim + i]
            if use_qk_norm:
                _rms_norm_in_place(head, q_weight if h < num_heads else k_weight, eps)
            for i in range(head_dim):
                partner = -head[i + half] if i < half else head[i - half]
                value = head[i] * cos[r, i] + partner * sin[r, i]
                if h < num_heads:
                    q_out[r, h, i] = value
                else:
                    k_cache[slot, h - num_heads, i] = value
        base = (num_heads + num_kv_heads) * head_dim
        for h in range(num_kv_heads):
            for i in range(head_dim):
                v_cache[slot, h, i] = row[base + h * head_dim + i]


@_jit
def _decode_attention_rows(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out):
    """One query token per row over its paged context ``[slots, Hkv, D]``; out bf16 bits
    ``[rows, Hq * D]`` (what o_proj reads). Scores and softmax in float32, in slot order; each
    K and V row is read once for the query heads of its group."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    longest = 0
    for r in range(rows):
        longest = max(longest, seq_lens[r])
    scores = np.empty((group, longest), np.float32)
    slot_of = np.empty(longest, np.int64)
    acc = np.empty((group, head_dim), np.float32)
    row_out = np.empty(num_heads * head_dim, np.float32)
    for r in range(rows):
        length = seq_lens[r]
        for t in range(length):
            slot_of[t] = block_tables[r, t // block_size] * block_size + t % block_size
        for kv_head in range(num_kv_heads):
            for t in range(length):
                k_row = k_cache[slot_of[t], kv_head]
                for g in range(group):
                    q_row = q[r, kv_head * group + g]
                    dot = np.float32(0.0)
                    for i in range(head_dim):
                        dot += q_row[i] * k_row[i]
                    scores[g, t] = dot * np.float32(scale)
            for g in range(group):
                top = scores[g, 0]
                for t in range(1, length):
                    top = max(top, scores[g, t])
                total = np.float32(0.0)
                for t in range(length):
                    scores[g, t] = np.exp(scores[g, t] - top)
                    total += scores[g, t]
                for t in range(length):
                    scores[g, t] /= total
            acc[:, :] = 0.0
            for t in range(length):
                v_row = v_cache[slot_of[t], kv_head]
                for g in range(group):
                    for i in range(head_dim):
                        acc[g, i] += scores[g, t] * v_row[i]
            for g in range(group):
                for i in range(head_dim):
                    row_out[(kv_head * group + g) * head_dim + i] = acc[g, i]
        _f32_to_bf16(row_out, out[r])


@_jit
def _rope_write_attend_rows(
    qkv_bits, cos, sin, num_heads, num_kv_heads, q_weight, k_weight, eps, use_qk_norm,
    k_cache, v_cache, slots, block_tables, seq_lens, block_size, scale, out,
):  # fmt: skip
    """`_rope_write_rows`, then `_decode_attention_rows` (one call from Python)."""
    q = np.empty((qkv_bits.shape[0], num_heads, cos.shape[1]), np.float32)
    _rope_write_rows(
        qkv_bits, cos, sin, num_heads, num_kv_heads, q_weight, k_weight, eps, use_qk_norm,
        k_cache, v_cache, slots, q,
    )  # fmt: skip
    _decode_attention_rows(q, k_cache, v_cache, block_tables, seq_lens, block_size, scale, out)


def _bits(t: Tensor) -> np.ndarray:
    """A bfloat16 tensor's bits as an int16 array (a view)."""
    return t.view(torch.int16).numpy()


def _bf16(rows: int, width: int) -> tuple[Tensor, np.ndarray]:
    """A new bfloat16 tensor [rows, width] and its bits' array.

    NOTE: allocated by torch, not numpy: PyTorch's CPU kernels may assume its 64-byte
    alignment (the int8 matmul crashed on a 16-byte aligned numpy buffer)."""
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    return out, _bits(out)


class Arrays:
    """numpy views of tensors that live as long as the model (weights), made once: a view
    costs about 1 us, and a step asks for a few hundred."""

    def __init__(self) -> None:
        # NOTE: keyed by id(): a view holds its tensor, so no other tensor takes that id
        self._views: dict[int, np.ndarray] = {}

    def __call__(self, t: Tensor) -> np.ndarray:
        view = self._views.get(id(t))
        if view is None:
            view = self._views[id(t)] = t.numpy()
        return view


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: np.ndarray, eps: float
) -> tuple[Tensor, Tensor]:
    """bfloat16 x [T, D] (a GEMM's output) + float32 residual -> (bfloat16 norm, float32 sum)."""
    h = torch.empty_like(residual)
    normed, bits = _bf16(*residual.shape)
    _add_rms_norm_rows(_bits(x), residual.numpy(), weight, eps, h.numpy(), bits)
    return normed, h


def rms_norm(x: Tensor, weight: np.ndarray, eps: float) -> Tensor:
    """float32 x [T, D] -> bfloat16 rms_norm(x) * weight."""
    normed, bits = _bf16(*x.shape)
    _rms_norm_rows(x.numpy(), weight, eps, bits)
    return normed


def silu_mul(gate_up: Tensor) -> Tensor:
    """bfloat16 [T, 2 I] -> bfloat16 silu(gate) * up [T, I]."""
    out, bits = _bf16(gate_up.shape[0], gate_up.shape[1] // 2)
    _silu_mul_rows(_bits(gate_up), bits)
    return out


def rope_write_attend(
    qkv: Tensor,
    heads: tuple[int, int, int],
    qk_norm: tuple[np.ndarray, np.ndarray, float] | None,
    kv_cache: tuple[Tensor, Tensor],
    step: tuple[np.ndarray, ...],
    scale: float,
) -> Tensor:
    """A decode step's attention from its bfloat16 fused q/k/v rows: q and k rotated (and
    normed when asked), k and v written at their slots, then each row's query over its paged
    context -> bfloat16 ``[T, Hq * D]`` (what o_proj reads). `step` holds the step's cos, sin
    ``[T, D]``, slots ``[T]``, block tables ``[T, width]`` and lengths ``[T]``."""
    num_heads, num_kv_heads, head_dim = heads
    cos, sin, slots, block_tables, seq_lens = step
    rows = qkv.shape[0]
    k_cache, v_cache = (c.view(-1, num_kv_heads, head_dim).numpy() for c in kv_cache)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos[0], cos[0], 0.0)
    out, bits = _bf16(rows, num_heads * head_dim)
    _rope_write_attend_rows(
        _bits(qkv), cos, sin, num_heads, num_kv_heads, q_weight, k_weight, eps,
        qk_norm is not None, k_cache, v_cache, slots, block_tables, seq_lens,
        kv_cache[0].shape[1], scale, bits,
    )  # fmt: skip
    return out
