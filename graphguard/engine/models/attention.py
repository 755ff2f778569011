"""Paged prefill attention in plain PyTorch (SDPA), and the attention metadata of a step.

Decode attention and the K/V cache write are kernels of the engine's kernel set
(graphguard/kernels: `decode_attention`, `write_kv` in the reference set).

K/V live in blocks of ``block_size`` tokens; a sequence's blocks are listed in its row of
``block_tables``. Token ``t`` of a sequence lives at slot ``block * block_size + t % block_size``
with ``block = block_tables[seq, t // block_size]``.

A prefill of many short prompts would pay one attention call per sequence per layer (most of
such a step's time on a GPU: docs/benchmarks.md, "Design notes"), so the model runner plans
*prefill groups* once per step: short sequences of similar length padded to a common length
and attended in one masked call. A group's padded attention area is at most ``MAX_PAD_RATIO``
times its real area (or under ``SMALL_GROUP_AREA``, where padding costs nothing that matters)
and never above ``MAX_GROUP_AREA``; a sequence longer than ``MAX_GROUPED_LEN`` is attended
alone, causally, as one call per layer no longer costs much next to its work (and a masked
call would give up the flash kernels and, on some backends, materialize the scores). A
continued chunked prefill is a group of one that attends over its paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# A group's padded attention area (num_seqs * length**2) may be this many times the real one
# (the sum of each length**2), or up to SMALL_GROUP_AREA, where launches cost more than math;
# it never exceeds MAX_GROUP_AREA (the mask's bytes; the scores' elements per head).
MAX_PAD_RATIO = 1.5
SMALL_GROUP_AREA = 16384
MAX_GROUP_AREA = 1 << 20
MAX_GROUPED_LEN = 256  # longer sequences are attended alone
# NOTE: not cuDNN's attention: its first call of each new shape of a masked group is slow
# (tens of ms; over a second for the process's first), and group shapes change with every
# wave of prompts (docs/benchmarks.md, "Design notes").
PREFILL_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


@dataclass(frozen=True)
class PrefillGroup:
    """Sequences of one prefill padded to ``length`` tokens for one attention call.

    ``start``/``end`` bound the packed rows of a group of one sequence (no padding, no index);
    one whose ``cached_row`` is set continues a prefill and attends over its first
    ``context_len`` cached + new tokens (row ``cached_row`` of the block tables). For more,
    padded slot ``i * length + j`` holds packed row ``gather[i * length + j]`` (the
    sequence's first row where j is past its end), ``mask`` allows key j for query i when
    ``j <= i`` and j is inside the sequence, and ``dest``/``src`` map real packed rows to
    their padded slots.
    """

    num_seqs: int
    length: int
    start: int = 0
    end: int = 0
    cached_row: int | None = None  # a continued prefill: its row in the batch
    context_len: int = 0  # its cached + new tokens
    gather: Tensor | None = None  # [num_seqs * length] int64, on gpu
    src: Tensor | None = None  # [real tokens] int64, on gpu: padded slots
    dest: Tensor | None = None  # [real tokens] int64, on gpu: packed rows
    mask: Tensor | None = None  # [num_seqs, 1, length, length] bool, on gpu


def plan_prefill_groups(
    query_lens: list[int], seq_lens: list[int], device: torch.device | str
) -> tuple[PrefillGroup, ...]:
    """Group a prefill's sequences for batched attention. A sequence with cached tokens (a
    chunked prefill going on) is a group of one that attends over the paged cache.

    Longest first, a group grows while its padded area stays within MAX_PAD_RATIO of its real
    area (or within SMALL_GROUP_AREA) and within MAX_GROUP_AREA, so prompts of similar length
    share a call and a long prompt does not pad short ones up to its length. Sequences longer
    than MAX_GROUPED_LEN are groups of one.
    """
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    fresh = [i for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)) if q == s]
    continued = tuple(
        PrefillGroup(1, query_lens[i], starts[i], starts[i + 1], i, seq_lens[i])
        for i in range(len(query_lens))
        if query_lens[i] != seq_lens[i]
    )
    groups: list[list[int]] = []
    for index in sorted(fresh, key=lambda i: -query_lens[i]):
        group = groups[-1] if groups else []
        if group and query_lens[group[0]] <= MAX_GROUPED_LEN:
            padded = (len(group) + 1) * query_lens[group[0]] ** 2
            real = sum(query_lens[i] ** 2 for i in group) + query_lens[index] ** 2
            fits = padded <= max(MAX_PAD_RATIO * real, SMALL_GROUP_AREA)
            if fits and padded <= MAX_GROUP_AREA:
                group.append(index)
                continue
        groups.append([index])
    return tuple(_build_group(g, query_lens, starts, device) for g in groups) + continued


def _build_group(
    group: list[int], lens: list[int], starts: list[int], device: torch.device | str
) -> PrefillGroup:
    length = lens[group[0]]
    if len(group) == 1:
        return PrefillGroup(1, length, starts[group[0]], starts[group[0]] + length)
    gather: list[int] = []
    src: list[int] = []
    dest: list[int] = []
    for index in group:
        first = starts[index]
        for j in range(length):
            if j < lens[index]:
                src.append(len(gather))
                dest.append(first + j)
                gather.append(first + j)
            else:
                gather.append(first)
    # One copy to the device for the three index lists.
    indices = torch.tensor(gather + src + dest, dtype=torch.int64, device=device)
    total = len(src)
    group_lens = torch.tensor([lens[i] for i in group], device=device)
    pos = torch.arange(length, device=device)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    inside = pos[None, None, :] < group_lens[:, None, None]  # [seq, 1, key]
    return PrefillGroup(
        num_seqs=len(group),
        length=length,
        gather=indices[: len(gather)],
        src=indices[len(gather) : len(gather) + total],
        dest=indices[len(gather) + total :],
        mask=(causal[None] & inside)[:, None],
    )


@dataclass
class AttentionMetadata:
    """Where the current tokens' K/V go and what each sequence attends over.

    ``packed``: the queries of each sequence are packed together (a packed prefill: varlen
    attention over the paged cache). Else one query token per row, each over its own paged
    context: a decode, or a short prefill run as rows (engine/shapes.py `prefills_as_rows`)."""

    packed: bool
    slot_mapping: Tensor  # [num_tokens] int64, on gpu: block * block_size + offset
    block_tables: Tensor  # [num_seqs, width] int32, on gpu, padded with DUMMY_BLOCK
    seq_lens: Tensor  # [num_seqs] int32, on gpu: context length incl. the new tokens
    query_start_loc: Tensor  # [num_seqs + 1] int32, on gpu: cumulative query lengths
    seq_lens_cpu: list[int] | None = None  # packed only (its attention is eager)
    query_lens_cpu: list[int] | None = None  # packed only
    # packed only: how the sequences share attention calls (None: plan_prefill_groups)
    prefill_groups: tuple[PrefillGroup, ...] | None = None


def paged_prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    """Causal attention of each sequence's new tokens over its cached + new tokens (eager):
    one call per PrefillGroup of ``meta.prefill_groups`` (planned here when the metadata has
    none). Expects the new K/V to be written to the cache already; sequences without cached
    tokens attend over the new k/v directly."""
    groups = meta.prefill_groups
    if groups is None:
        if meta.seq_lens_cpu is None or meta.query_lens_cpu is None:
            raise ValueError("prefill needs seq_lens_cpu and query_lens_cpu")
        groups = plan_prefill_groups(meta.query_lens_cpu, meta.seq_lens_cpu, q.device)
    out = torch.empty_like(q)
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        for group in groups:
            rows = slice(group.start, group.end)
            if group.cached_row is not None:
                table = meta.block_tables[group.cached_row]
                k_seq, v_seq = _gather_context(k_cache, v_cache, table, group.context_len)
                out[rows] = _causal_sdpa(q[rows], k_seq, v_seq, scale)
                continue
            if group.gather is None:
                out[rows] = _causal_sdpa(q[rows], k[rows], v[rows], scale)
                continue
            assert group.src is not None and group.dest is not None and group.mask is not None
            qp, kp, vp = (_padded(x, group) for x in (q, k, v))
            attended = _masked_sdpa(qp, kp, vp, group.mask, scale)
            flat = attended.transpose(1, 2).reshape(group.num_seqs * group.length, *q.shape[1:])
            out.index_copy_(0, group.dest, flat.index_select(0, group.src))
    return out


def _padded(x: Tensor, group: PrefillGroup) -> Tensor:
    """Packed ``[T, H, D]`` -> padded ``[num_seqs, H, length, D]``."""
    assert group.gather is not None
    rows = x.index_select(0, group.gather)
    return rows.view(group.num_seqs, group.length, *x.shape[1:]).transpose(1, 2)


def _gather_context(
    k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_len: int
) -> tuple[Tensor, Tensor]:
    """The first ``seq_len`` cached K/V of one sequence, each ``[seq_len, Hkv, D]``."""
    block_size = k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q ``[Tq, Hq, D]`` over k/v ``[Tk, Hkv, D]``; the queries are the last Tq of Tk tokens."""
    query_len, ctx_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if query_len == ctx_len:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Query i sits at absolute position ctx_len - query_len + i and sees keys up to it.
        q_pos = torch.arange(ctx_len - query_len, ctx_len, device=q.device)
        allowed = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
        out = _masked_sdpa(qh, kh, vh, allowed, scale)
    return out.transpose(0, 1)


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA with a boolean mask, q ``[..., Hq, L, D]`` over k/v ``[..., Hkv, S, D]``.

    NOTE: the K/V heads are repeated up to the query heads here rather than by `enable_gqa`:
    the memory-efficient kernel takes a mask but not grouped heads, so with `enable_gqa` a
    masked call fell to the math backend, several times slower, once per group and layer
    (docs/benchmarks.md, "Design notes")."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
