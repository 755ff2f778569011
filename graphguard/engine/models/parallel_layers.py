"""The collectives of a tensor-parallel shard, and the layers that call them.

A ModelShard is built once per rank and handed to the model it shards: row-parallel linears
(o_proj, down_proj) all-reduce their partial sums, the vocabulary-parallel embedding looks up
its own rows and all-reduces, and the LM head's logits of the rank's vocabulary are gathered.
These collectives run eagerly or inside a captured graph alike (NCCL supports capture).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from graphguard.engine.models.layers import Linear


@dataclass(frozen=True)
class ModelShard:
    """Rank `rank` of `world_size`: its vocabulary rows and the group its collectives use."""

    rank: int
    world_size: int
    vocab: range  # the embedding / LM head rows this rank holds
    vocab_size: int  # the whole vocabulary's
    group: Any = None  # the process group of the model's collectives (None: the default one)

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """[n, len(vocab)] on each rank -> [n, vocab_size] on every rank."""
        width = -(-self.vocab_size // self.world_size)  # NOTE: the first ranks hold one more
        padded = torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        sizes = [len(part) for part in split_range(self.vocab_size, self.world_size)]
        return torch.cat([part[:, :size] for part, size in zip(parts, sizes, strict=True)], 1)

    def embedding(self, hidden_size: int) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(self, hidden_size)

    def lm_head(self, hidden_size: int) -> nn.Linear:
        return nn.Linear(hidden_size, len(self.vocab), bias=False)

    def row_parallel(self, linear: nn.Linear) -> RowParallelLinear:
        return RowParallelLinear(self, linear.in_features, linear.out_features)


class RowParallelLinear(Linear):
    """A linear over this rank's slice of the input features; the partial sums all-reduced.
    Its weight keeps the checkpoint's name (`o_proj.weight`), holding the rank's columns."""

    def __init__(self, shard: ModelShard, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.shard = shard

    def reduce(self, out: Tensor) -> Tensor:
        return self.shard.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """The rows of `shard.vocab`; other ids give zeros here and their row on another rank."""

    def __init__(self, shard: ModelShard, hidden_size: int) -> None:
        super().__init__()
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(len(shard.vocab), hidden_size))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.shard.vocab.start
        held = (local >= 0) & (local < len(self.shard.vocab))
        h = torch.nn.functional.embedding(local.clamp(0, len(self.shard.vocab) - 1), self.weight)
        # NOTE: multiplying by 1 or 0 keeps the held rows' bits: the sum over ranks is exact.
        return self.shard.all_reduce(h * held[:, None].to(h.dtype))


def split_range(size: int, parts: int) -> list[range]:
    """`size` items in `parts` contiguous ranges, the first ones one longer when uneven."""
    base, extra = divmod(size, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (index < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]
