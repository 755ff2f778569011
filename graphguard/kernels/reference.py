"""The decoder's kernels in plain PyTorch: the CPU path, and the reference the fused kernels
are tested against.

Every method takes and returns tensors in the model dtype; norms and softmax compute in float32
and cast back, as the reference models do. `TorchKernels` is also the base of the fused sets,
which override what they fuse and inherit the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class HeadShape(NamedTuple):
    """The attention heads of one layer: a fused q/k/v row is ``(num_heads + 2 *
    num_kv_heads) * head_dim`` wide, q heads first, then k, then v."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class QKNorm(NamedTuple):
    """Per-head RMSNorm weights ``[head_dim]`` applied to q and k before RoPE (Qwen3)."""

    q_weight: Tensor
    k_weight: Tensor
    eps: float


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: float32 statistics, cast back, then scaled by ``weight``."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [T, H, D]`` by per-token cos/sin ``[T, D]`` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def split_qkv(qkv: Tensor, heads: HeadShape) -> tuple[Tensor, Tensor, Tensor]:
    """``[T, (Hq + 2 Hkv) * D]`` -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (views)."""
    num_tokens = qkv.shape[0]
    q_dim, kv_dim = heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim
    q, k, v = qkv.split((q_dim, kv_dim, kv_dim), dim=-1)
    shape = (num_tokens, -1, heads.head_dim)
    return q.view(shape), k.view(shape), v.view(shape)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """One query token per sequence over its paged context; q ``[B, Hq, D]`` -> ``[B, Hq, D]``.

    NOTE: capturable in a CUDA graph: no host syncs, and every shape comes from
    ``(B, width)``; the context is ``width * block_size`` slots with slots >= seq_len masked.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    ctx_len = block_tables.shape[1] * block_size
    tables = block_tables.long()
    # [B, width, block_size, Hkv, D] -> [B, Hkv, ctx, D]
    k = k_cache[tables].view(num_seqs, ctx_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[tables].view(num_seqs, ctx_len, num_kv_heads, head_dim).transpose(1, 2)
    # Query head h reads KV head h // group (the repeat_interleave layout of GQA).
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, ctx]
    slots = torch.arange(ctx_len, device=q.device)
    is_past_end = slots.view(1, 1, 1, ctx_len) >= seq_lens.view(num_seqs, 1, 1, 1)
    scores = scores.masked_fill(is_past_end, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


class TorchKernels:
    """The decoder's kernels as plain PyTorch ops (several launches each)."""

    name = "torch"
    # what the engine loads the weights in for prepare(), and runs the model in after it
    # (None: the engine's dtype for both)
    load_dtype: torch.dtype | None = None
    run_dtype: torch.dtype | None = None
    # why weights loaded in place (reload_weights) cannot serve this set; None: they can
    no_reload: str | None = None
    # the largest prefill (tokens x longest context) that runs with its tokens as rows of
    # `decode_attention` (graphguard/engine/models/forward.py `prefills_as_rows`); 0: never, as this
    # set's decode attention gathers every row's whole context
    row_prefill_area = 0
    # whether `prefill_attention` reads the metadata's prefill groups (`plan_prefill_groups`,
    # planned on the host every packed prefill step); a set whose kernel attends all of a
    # step's sequences in one launch needs none planned
    needs_prefill_groups = True
    # whether `prefill_attention` reads only the metadata's device tensors (no host-side
    # lengths, no host sync), so a packed prefill's attention can be captured with the rest of
    # the step: the prefill pipeline is then one segment, a whole graph per (tokens, sequences,
    # table width) key (graphguard/engine/models/forward.py `prefill_stages`)
    whole_prefill_graphs = False

    def prepare(self, model: nn.Module) -> None:
        """Ready the set for `model`'s weights (at start and after weights are loaded in
        place); the plain ops need nothing."""

    def opt_ins(self) -> tuple[str, ...]:
        """What the environment changed in this set from its defaults (the startup log names
        it)."""
        return ()

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x [M, K] @ weight[N, K].T`` (no bias)."""
        return F.linear(x, weight)

    def head(self, x: Tensor, weight: Tensor) -> Tensor:
        """The LM head's GEMM, ``x [M, K] @ weight[vocab, K].T``."""
        return F.linear(x, weight)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """``h = x + residual`` -> (rms_norm(h), h): the pre-norm block's residual step."""
        h = x + residual
        return rms_norm(h, weight, eps), h

    def norm_linear(
        self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(linear(rms_norm(x + residual)), x + residual): a pre-norm block's norm and the GEMM
        it feeds. Without a residual the sum is x itself."""
        if residual is None:
            return self.linear(self.rms_norm(x, norm_weight, eps), weight), x
        normed, summed = self.add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(normed, weight), summed

    def silu_linear(self, gate_up: Tensor, weight: Tensor) -> Tensor:
        """``linear(silu_mul(gate_up))``: the MLP's activation and the down projection."""
        return self.linear(self.silu_mul(gate_up), weight)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """``[T, 2 I]`` (gate, then up) -> ``silu(gate) * up`` ``[T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_qkv(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, heads: HeadShape, qk_norm: QKNorm | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Fused q/k/v rows -> q, k (q/k-normed when given, then rotated) and v."""
        q, k, v = split_qkv(qkv, heads)
        if qk_norm is not None:
            q = rms_norm(q, qk_norm.q_weight, qk_norm.eps)
            k = rms_norm(k, qk_norm.k_weight, qk_norm.eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def rope_qkv_write(
        self,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        heads: HeadShape,
        qk_norm: QKNorm | None,
        kv_cache: tuple[Tensor, Tensor],
        slot_mapping: Tensor,
    ) -> Tensor:
        """`rope_qkv`, with k and v stored at their cache slots; returns q ``[T, Hq, D]``."""
        q, k, v = self.rope_qkv(qkv, cos, sin, heads, qk_norm)
        write_kv(*kv_cache, k, v, slot_mapping)
        return q

    def decode_attention(
        self,
        q: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        block_tables: Tensor,
        seq_lens: Tensor,
        scale: float,
    ) -> Tensor:
        """One query token per row over its paged context (see `decode_attention`)."""
        return decode_attention(q, *kv_cache, block_tables, seq_lens, scale)

    def prefill_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: tuple[Tensor, Tensor],
        meta: Any,
        scale: float,
    ) -> Tensor:
        """Causal attention of a packed prefill's new tokens ``q [T, Hq, D]`` (their K/V `k`, `v`
        ``[T, Hkv, D]``, already written to `kv_cache`) over each sequence's cached and new
        tokens -> ``[T, Hq, D]``. `meta` is the step's AttentionMetadata (graphguard/engine/models/
        attention.py, whose `paged_prefill_attention` this is: SDPA per prefill group)."""
        # NOTE: imported here: the engine's models import this module, and the plain PyTorch
        # prefill attention lives beside the metadata it reads.
        from graphguard.engine.models.attention import paged_prefill_attention

        return paged_prefill_attention(q, k, v, *kv_cache, meta, scale)

    def attend_decode(
        self,
        qkv: Tensor,
        rope: tuple[Tensor, Tensor],
        heads: HeadShape,
        qk_norm: QKNorm | None,
        kv_cache: tuple[Tensor, Tensor],
        slot_mapping: Tensor,
        block_tables: Tensor,
        seq_lens: Tensor,
        scale: float,
    ) -> Tensor:
        """A decode step's attention from its fused q/k/v rows: `rope_qkv_write`, then
        `decode_attention` -> ``[T, Hq, D]`` (or ``[T, Hq * D]``); a set that fuses the two
        overrides this."""
        q = self.rope_qkv_write(qkv, *rope, heads, qk_norm, kv_cache, slot_mapping)
        return self.decode_attention(q, kv_cache, block_tables, seq_lens, scale)

    def decode_layers(
        self,
        layers: nn.ModuleList,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        meta: Any,
        kv: Any,
    ) -> tuple[Tensor, Tensor] | None:
        """A decode step's decoder layers run by the set itself -> (last layer's output,
        residual), or None: the model runs them layer by layer (every set but one). For a set
        whose calls cost more than their math (kernels/q4.py). `meta` and `kv` are the step's
        attention metadata and paged KV storage (graphguard/engine)."""
        return None
