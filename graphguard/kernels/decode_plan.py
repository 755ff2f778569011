"""The split plan of the paged decode attention (graphguard/kernels/triton_decode.py): how many
pieces a launch cuts each row's context into, and the tile and launch shape of the kernel that
walks them. Plain Python, so the rule can be read, tested and benchmarked without Triton.

The rule (SplitRule.plan) reads (block-table width, rows, KV heads) only, and the rows only
through the power of two at or above them: see its NOTE for what that keeps deterministic.
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


@dataclass(frozen=True)
class SplitRule:
    """How a launch's split plan follows from its shape (`plan`).

    A context of up to `direct_tokens` slots is one split whose program writes the output
    directly: no merge launch, which costs more than a short context's split saves. Longer
    contexts split until the launch has about `target_programs` programs (rows x KV heads x
    splits), never into splits shorter than `min_split_tokens` (a split's partial costs a
    write and a read of 4 * head_dim bytes per query head: 2 * group / split_tokens of its K/V
    bytes) nor more than `max_splits`. The width is the longest row's context rounded up to a
    power of two of blocks (engine/shapes.py `width_bucket`), so the rows fill between half of
    it and all of it and the splits past a row's end return at once: 1,024 programs are 512 to
    1,024 working ones, a few waves of a 132-SM device. Measured on an H200 (bench/
    decode_attention.py, docs/benchmarks.md), 1,024 beat 2,048 and 4,096 at one row of 8k and
    32k and tied them at 16 rows.
    """

    target_programs: int = 1024
    min_split_tokens: int = 128
    max_splits: int = 256
    direct_tokens: int = 256
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        tile = self.block_n
        if tile < 16 or tile & (tile - 1) or min(self.target_programs, self.max_splits) < 1:
            raise ValueError(f"unusable split rule {self}")

    def plan(self, ctx_tokens: int, num_rows: int, num_kv_heads: int) -> SplitPlan:
        """The plan of a launch over `num_rows` rows, `num_kv_heads` KV heads and a block
        table of `ctx_tokens` slots: as many splits as bring it to `target_programs`, counting
        the rows as the power of two at or above `num_rows`, within the bounds above; each
        split a whole number of tiles. With 8 KV heads, one row of an 8k context (a 16k-slot
        width) gets 128 splits of 128 tokens and one of 32k (64k slots) 128 of 512; 16 rows of
        8k get 8 splits of 2,048 tokens, 16 of 32k 8 of 8,192: few, long splits once the rows
        fill the device themselves.

        NOTE: a function of (width, rows rounded up to a power of two, KV heads): not of the
        device, nor of the rows' lengths, so a graph key's replay equals its eager call (both
        see the key's padded rows), and a row gives the same bits in an unpadded eager batch
        as in the batch bucket it pads to when the buckets are powers of two (the default
        ones: GraphConfig.batch_buckets, and the row buckets of prefills run as rows).
        """
        splits = 1
        if ctx_tokens > self.direct_tokens:
            rows = 1 << (max(1, num_rows) - 1).bit_length()
            by_load = self.target_programs // (rows * num_kv_heads)
            by_width = ctx_tokens // self.min_split_tokens
            splits = max(1, min(by_load, by_width, self.max_splits))
        tile = self.block_n
        split_tokens = _cdiv(_cdiv(ctx_tokens, splits), tile) * tile
        num_splits = _cdiv(ctx_tokens, split_tokens)
        return SplitPlan(num_splits, split_tokens, tile, self.num_warps, self.num_stages)


SPLIT_RULE = SplitRule()


def plan_splits(
    ctx_tokens: int, num_rows: int, num_kv_heads: int, rule: SplitRule = SPLIT_RULE
) -> SplitPlan:
    """`rule`'s plan for a launch of this shape (SplitRule.plan)."""
    return rule.plan(ctx_tokens, num_rows, num_kv_heads)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
