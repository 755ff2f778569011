"""How many KV blocks an engine's pool gets when the configuration leaves it open."""

from __future__ import annotations

import torch

from graphguard.engine.config import EngineConfig, ModelConfig
from graphguard.engine.scheduling.kv import PagedKVStorage
from graphguard.engine.scheduling.sequence import num_blocks_for

KV_SHARE_OF_FREE_CUDA_MEMORY = 0.5  # the rest stays for weights' activations and graph pools
KV_BYTES_ON_CPU = 1 << 30


def build_kv(
    config: EngineConfig,
    mc: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> PagedKVStorage:
    """The engine's KV pool: `config.num_kv_blocks` blocks, or `auto_num_blocks` when 0."""
    num_blocks = config.num_kv_blocks or auto_num_blocks(config, mc, max_model_len, device, dtype)
    return kv_storage(mc, num_blocks, config.block_size, device, dtype)


def kv_storage(
    mc: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
) -> PagedKVStorage:
    """A pool of `num_blocks` blocks for `mc`'s layers and KV heads (a tensor-parallel
    follower's holds the blocks rank 0 sized, for its share of the heads)."""
    return PagedKVStorage(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )


def auto_num_blocks(
    config: EngineConfig,
    mc: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Enough blocks for max_num_seqs full-length requests, within a memory allowance.

    The allowance is a share of the device's free memory on CUDA and a fixed size on CPU,
    so that a laptop start does not zero gigabytes; the scheduler preempts past it.
    """
    block_size = config.block_size
    per_seq = num_blocks_for(max_model_len, block_size)
    wanted = config.max_num_seqs * per_seq + 1  # + the reserved dummy block
    block_bytes = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim
    block_bytes *= dtype.itemsize
    if device.type == "cuda":
        allowance = cuda_allowance(config.gpu_memory_utilization, device)
    else:
        allowance = KV_BYTES_ON_CPU
    return max(per_seq + 1, min(wanted, allowance // block_bytes))


def cuda_allowance(utilization: float, device: torch.device) -> int:
    """The KV pool's bytes on a GPU: a share of the free memory, or (vLLM's
    gpu_memory_utilization) what that share of the whole memory leaves after what the
    process holds already (the weights); ValueError where that is nothing."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    if not utilization:
        return int(free_bytes * KV_SHARE_OF_FREE_CUDA_MEMORY)
    held = torch.cuda.memory_reserved(device)
    allowance = min(int(utilization * total_bytes) - held, free_bytes)
    if allowance <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {utilization * total_bytes / 2**30:.1f}"
            f" GiB, and the weights hold {held / 2**30:.1f} GiB already: no room for the KV cache"
        )
    return allowance
