"""Which part of the model a tensor-parallel rank holds, and building that shard.

Attention splits by KV groups: a rank holds whole groups (a KV head and the query heads that
read it), so every rank's HeadShape is a valid GQA shape of its own and the kernel sets run
unchanged on the local heads. With fewer KV heads than ranks each KV head is replicated on
`world_size // num_kv_heads` ranks, which split its group's query heads. The MLP splits its
intermediate columns; the vocabulary splits its rows. Uneven splits are allowed (SmolLM2's
3 KV heads on 2 ranks: 2 groups and 1). q/k/v and gate/up are sliced before they are fused, so
the shard fuses its own rows into one GEMM each, as a whole model does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from graphguard.engine.config import ModelConfig
from graphguard.engine.models import DecoderModel, model_class
from graphguard.engine.models.parallel_layers import ModelShard, split_range


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank`'s query heads, KV heads, MLP columns and vocabulary rows."""

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    mlp: range
    vocab: range

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The rank's shapes (the vocabulary stays whole: logits are gathered)."""
        return dataclasses.replace(
            config,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.mlp),
        )


def shard_plan(config: ModelConfig, world_size: int, rank: int) -> ShardPlan:
    """What rank `rank` of `world_size` holds; ValueError when the heads cannot split."""
    kv, group = config.num_kv_heads, config.num_heads // config.num_kv_heads
    if kv >= world_size:
        kv_heads = split_range(kv, world_size)[rank]
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
    elif world_size % kv == 0 and group % (world_size // kv) == 0:
        replicas = world_size // kv
        kv_heads = range(rank // replicas, rank // replicas + 1)
        part = split_range(group, replicas)[rank % replicas]
        q_heads = range(kv_heads.start * group + part.start, kv_heads.start * group + part.stop)
    else:
        raise ValueError(
            f"{config.num_heads} query heads in {kv} KV groups do not split over {world_size} "
            "ranks: use a size that divides the KV heads, or a multiple of them that divides "
            "each group"
        )
    mlp = split_range(config.intermediate_size, world_size)[rank]
    vocab = split_range(config.vocab_size, world_size)[rank]
    return ShardPlan(rank, world_size, q_heads, kv_heads, mlp, vocab)


def shard_weights(
    config: ModelConfig, weights: Mapping[str, Tensor], plan: ShardPlan
) -> dict[str, Tensor]:
    """The rank's slices of a whole model's weights (checkpoint names, unfused)."""
    d = config.head_dim
    q = slice(plan.q_heads.start * d, plan.q_heads.stop * d)
    kv = slice(plan.kv_heads.start * d, plan.kv_heads.stop * d)
    mlp, vocab = _slice(plan.mlp), _slice(plan.vocab)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    columns = {"o_proj": q, "down_proj": mlp}
    shard: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        if module in rows:
            tensor = tensor[rows[module]]
        elif module in columns:
            tensor = tensor[:, columns[module]]
        elif module in ("embed_tokens", "lm_head"):
            tensor = tensor[vocab]
        shard[name] = tensor.contiguous()
    return shard


def build_shard(
    config: ModelConfig,
    weights: Mapping[str, Tensor],
    shard: ModelShard,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> DecoderModel:
    """Rank `shard.rank`'s model from a whole model's weights, on `device`."""
    plan = shard_plan(config, shard.world_size, shard.rank)
    with torch.device("meta"):
        model = model_class(config.arch)(plan.local_config(config), shard)
    state = shard_weights(config, weights, plan)
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.reset_buffers(device)
    model.rotary.build_table(config.max_position_embeddings, dtype)
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def model_shard(config: ModelConfig, world_size: int, rank: int, group: object) -> ModelShard:
    vocab = shard_plan(config, world_size, rank).vocab
    return ModelShard(rank, world_size, vocab, config.vocab_size, group)


def _slice(part: range) -> slice:
    return slice(part.start, part.stop)
