"""The split plan of the paged decode attention (graphguard/kernels/triton_decode.py): how many
pieces a launch cuts each row's context into, and the tile and launch shape of the kernel that
walks them. Plain Python, so the rule can be read, tested and benchmarked without Triton.

The rule (SplitRule.plan) reads the block-table width and the KV heads only, never the batch:
see its NOTE for why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

BLOCK_N = 64  # context tokens per tile, unless a rule says otherwise


class SplitPlan(NamedTuple):
    """How one launch walks its rows' contexts: `num_splits` pieces of `split_tokens` slots, a
    whole number of `block_n`-token tiles each, and the partial kernel's warps and stages."""

    num_splits: int
    split_tokens: int
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    merge_programs: int = 1  # merge programs a query head: each takes head_dim / this dims
    merge_chunk: int = 16  # splits a merge program loads at once


@dataclass(frozen=True)
class SplitRule:
    """How a launch's split plan follows from its shape (`plan`).

    A context of up to `direct_tokens` slots is one split whose program writes the output
    directly: no merge launch, which costs more than a short context's split saves. Longer
    contexts split until one row has about `row_programs` programs (KV heads x splits), never
    into splits shorter than `min_split_tokens` (a split's partial costs a write and a read of
    4 * head_dim bytes per query head: 2 * group / split_tokens of its K/V bytes) nor more than
    `max_splits`. The merge of a split launch runs `merge_programs` programs a query head,
    each over its share of the head's dimensions, loading `merge_chunk` splits' partials at
    once (a chunk is one round trip to memory; the chunks are summed in split order); a launch
    of `wide_merge_splits` splits or more merges wider, `wide_merge_programs` programs a head
    loading `wide_merge_chunk` splits at once (one round trip for a 30k row's 64 partials,
    against four). The width is the longest row's context rounded up to a power of two of
    blocks (engine/shapes.py `width_bucket`), so a row fills between half of it and all of it
    and the splits past its end return at once. Measured on an H200 (bench/decode_attention.py,
    run 77 in docs/gpu-validation.md), this plan read one row of 32k in 55.7 us (the best plan
    that also counted the rows: 50.9) and 16 rows at 98% of the bandwidth. The wide merge
    replayed the whole 30k step in 0.964x the time (run 94); at 512 tokens (2 splits) it cost
    1.11x, so short contexts keep the narrow one.
    """

    row_programs: int = 512
    min_split_tokens: int = 256
    max_splits: int = 64
    direct_tokens: int = 256
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    merge_programs: int = 1
    merge_chunk: int = 16
    wide_merge_splits: int = 64
    wide_merge_programs: int = 8
    wide_merge_chunk: int = 64

    def __post_init__(self) -> None:
        tile = self.block_n
        if tile < 16 or tile & (tile - 1) or min(self.row_programs, self.max_splits) < 1:
            raise ValueError(f"unusable split rule {self}")
        for name in ("merge_programs", "merge_chunk", "wide_merge_programs", "wide_merge_chunk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")

    def plan(self, ctx_tokens: int, num_kv_heads: int) -> SplitPlan:
        """The plan of a launch over a block table of `ctx_tokens` slots and `num_kv_heads` KV
        heads: as many splits as give one row `row_programs` programs, within the bounds
        above; each split a whole number of tiles. With 8 KV heads: 64 splits of 256 tokens
        at a 16k-slot width (an 8k context), 64 of 1,024 at 64k slots.

        NOTE: not a function of the batch. A batch that rides a larger bucket's graph (the
        pad-up rule, GraphConfig.decode_pad_factor: one row on a graph of 16, three on one of
        64) walks its real rows as their own graph would; a plan that counted the padded rows
        gave one real row of a 16-row graph 8 splits, a tenth of the programs it needs at long
        context. And a row computes the same bits in any batch: unpadded, in its bucket, or
        riding another's. Not of the device either, nor of the rows' lengths, so a graph's
        replay equals its eager call.
        """
        splits = 1
        if ctx_tokens > self.direct_tokens:
            by_load = self.row_programs // num_kv_heads
            by_width = ctx_tokens // self.min_split_tokens
            splits = max(1, min(by_load, by_width, self.max_splits))
        tile = self.block_n
        split_tokens = _cdiv(_cdiv(ctx_tokens, splits), tile) * tile
        num_splits = _cdiv(ctx_tokens, split_tokens)
        merge = (self.merge_programs, self.merge_chunk)
        if num_splits >= self.wide_merge_splits:
            merge = (self.wide_merge_programs, self.wide_merge_chunk)
        return SplitPlan(num_splits, split_tokens, tile, self.num_warps, self.num_stages, *merge)


SPLIT_RULE = SplitRule()


def plan_splits(ctx_tokens: int, num_kv_heads: int, rule: SplitRule = SPLIT_RULE) -> SplitPlan:
    """`rule`'s plan for a launch of this shape (SplitRule.plan)."""
    return rule.plan(ctx_tokens, num_kv_heads)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
