"""Inputs and checks shared by the kernel tests: each fused kernel against the reference set,
on fresh random inputs, over the shapes of the two model families and awkward ones (odd
batches, contexts that end mid-block, GQA ratios 2 and 3)."""

from __future__ import annotations

import torch
from torch import Tensor

from graphguard.kernels import HeadShape, QKNorm, TorchKernels

# SmolLM2-135M (9 q heads over 3 KV heads, D 64) and Qwen3-0.6B (16 over 8, D 128)
HEADS = (HeadShape(9, 3, 64), HeadShape(16, 8, 128))
BLOCK_SIZE = 16


def rel_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected||, NaN-aware (a NaN anywhere is an infinite error)."""
    diff = actual.double() - expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return (diff.norm() / expected.double().norm().clamp_min(1e-30)).item()


def rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype, device) -> tuple[Tensor, ...]:
    angles = torch.rand(num_tokens, head_dim // 2, device=device) * 100
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qk_norm(heads: HeadShape, dtype: torch.dtype, device) -> QKNorm:
    weights = torch.rand(2, heads.head_dim, device=device) + 0.5
    return QKNorm(weights[0].to(dtype), weights[1].to(dtype), 1e-6)


def paged_batch(
    heads: HeadShape, lens: list[int], width: int, dtype: torch.dtype, device
) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor, Tensor]:
    """q [B, Hq, D], a K/V cache, shuffled block tables [B, width] and seq_lens [B]."""
    num_blocks = len(lens) * width + 1
    shape = (num_blocks, BLOCK_SIZE, heads.num_kv_heads, heads.head_dim)
    k_cache, v_cache = torch.randn(2, *shape, device=device).to(dtype)
    cache = (k_cache.contiguous(), v_cache.contiguous())
    order = torch.randperm(num_blocks - 1, device=device) + 1  # block 0 stays the dummy
    tables = order.view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), heads.num_heads, heads.head_dim, device=device).to(dtype)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32, device=device)


def float_norm(norm: QKNorm | None) -> QKNorm | None:
    """The same q/k norm in float32 (for the reference on upcast inputs)."""
    if norm is None:
        return None
    return QKNorm(norm.q_weight.float(), norm.k_weight.float(), norm.eps)


REFERENCE = TorchKernels()
