"""Linear layers of a few rows: a Triton kernel for the decode step's small batches.

At batch 1-16 a decoder GEMM reads its weight once and does almost no arithmetic; cuBLAS runs it
on a handful of 8x64 tiles (15 thread blocks for SmolLM2's q/k/v), so latency, not bandwidth,
sets its time. Here every program owns BLOCK_N output features for all rows (rows padded to 16
for the matrix unit) and walks its share of K in one fixed order: many more programs in flight,
and a result that does not depend on the batch of 2-16 it came in (each row is computed alone).

One row alone (batch-1 decode) takes `one_row_linear`: no matrix unit, no padding to 16 rows,
each program's whole share of the weight loaded at once (docs/kernels.md). Its sums are its own,
so a row alone and the same row in a batch agree within float32 rounding, not bit for bit.

A layer with few output features (a 1,024-wide o_proj or down_proj: 64 programs of 16 features
on a GPU of 132 SMs) can also split K (`plan_linear(split=True)`; the engine's only with
GRAPHGUARD_SPLIT_K=1: see the NOTE below): each split writes a float32 partial, and the last
of a column block's splits to finish (an arrival counter, reset by that program) adds the
partials in split order and writes the output. The sum's order is fixed, so the result is the
same bits on every call, in any batch, eager or replayed.

The kernel can also compute its input rows itself (`few_rows_norm_linear`,
`few_rows_silu_linear`, asked for with GRAPHGUARD_GEMM_PROLOGUES=1: docs/kernels.md): the
residual add and RMSNorm before a q/k/v or gate/up projection, or SiLU-and-multiply before the
down projection, each K tile computed as the separate kernel computes it, one launch fewer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphguard.kernels.launch import follow_previous, launch_flags, prefetch_l2

MAX_ROWS = 16  # rows the kernel takes; more go to cuBLAS
ONE_ROW_BLOCK_N = 4  # output features per program of the one-row kernel
ONE_ROW_TILE = 1024  # inputs per tile of the one-row kernel
BLOCK_N = 16  # output features per program
# Programs a split plan aims for: K splits until the column blocks times the splits reach it.
TARGET_PROGRAMS = 128
MAX_SPLITS = 8
MAX_UNITS = 1 << 16  # column blocks a split launch may count arrivals for
PLAIN, NORM, SILU = 0, 1, 2  # what the kernel does to its input rows before the GEMM
_NORM, _SILU = tl.constexpr(NORM), tl.constexpr(SILU)  # the same, as the kernels read them
# NOTE: the engine's plans split K only with GRAPHGUARD_SPLIT_K=1 (kernels/fused.py). Launches
# that share the arrival counters must not run side by side on the device. In the engine none
# do: steps and replays go on the step thread's stream, and a capture's warm-up on its own
# stream first waits for that stream and is waited for (core/backends.py `warm_up`). With
# split plans, runs 87 and 94 found staggered batches' greedy tokens changed (tests/gpu/
# test_engine_gpu.py), where batches of at most 16 rows that rode a 32-row graph (cuBLAS) were
# compared with eager ones (this kernel): numerically different paths, whose near-ties a
# different sum order can flip. Run 94 checked the graphs' parity with eager first and it held:
# not a race. The switch stays off because it paid nothing beside dependent launches (run 94,
# docs/kernels.md). `plan_linear(..., split=True)` gives the split plan for the benchmarks and
# the tests.


class LinearPlan(NamedTuple):
    """How `few_rows_linear` walks a weight: K in `splits` equal parts of `block_k`-wide tiles,
    with the given warps and pipeline stages."""

    splits: int = 1
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 5


@functools.lru_cache(maxsize=256)
def plan_linear(num_in: int, num_out: int, split: bool = False) -> LinearPlan:
    """The plan for a weight of `num_out` x `num_in`; with `split`, K split while the column
    blocks are fewer than TARGET_PROGRAMS, each split a whole number of tiles (a function of
    the weight's shape only, so a row's bits do not depend on its batch)."""
    plan = LinearPlan()
    blocks = triton.cdiv(num_out, BLOCK_N)
    if not split or blocks > MAX_UNITS:
        return plan
    splits = 1
    while (
        splits < MAX_SPLITS
        and blocks * splits < TARGET_PROGRAMS
        and num_in % (2 * splits * plan.block_k) == 0
    ):
        splits *= 2
    return plan._replace(splits=splits)


@triton.jit
def _input_tile(
    x_rows, r_rows, gamma_ptr, ks, is_row, is_k, inv_rms,
    NUM_IN: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The GEMM's input rows at columns `ks`: as stored (PLAIN); the residual sum RMS-normed
    by `inv_rms` and scaled, rounded where triton_norm rounds (NORM); or SiLU(gate) * up of
    rows that hold gate then up, as triton_mlp computes it (SILU)."""
    mask = is_row[:, None] & is_k[None, :]
    if PROLOGUE == _SILU:
        gate = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + NUM_IN + ks[None, :], mask=mask, other=0.0)
        silu = gate / (1.0 + tl.exp(-gate))
        tile = (silu * up.to(tl.float32)).to(up.dtype)
    else:
        tile = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        if PROLOGUE == _NORM:
            if HAS_RESIDUAL:
                residual = tl.load(r_rows + ks[None, :], mask=mask, other=0.0)
                tile = (tile.to(tl.float32) + residual.to(tl.float32)).to(tile.dtype)
            normed = (tile.to(tl.float32) * inv_rms[:, None]).to(tile.dtype).to(tl.float32)
            gamma = tl.load(gamma_ptr + ks, mask=is_k, other=0.0).to(tl.float32)
            tile = (gamma[None, :] * normed).to(tile.dtype)
    return tile


@triton.jit
def _row_inv_rms(
    x_rows, r_rows, sum_rows, is_row, eps, store_sum,
    NUM_IN: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """1 / RMS of each row's residual sum over all of K (the sum rounded to the input dtype
    first, as triton_norm does); where `store_sum`, the sum is stored at `sum_rows`."""
    squares = tl.zeros([ROWS], tl.float32)
    for tile in range(tl.cdiv(NUM_IN, BLOCK_K)):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = is_row[:, None] & (ks < NUM_IN)[None, :]
        x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(r_rows + ks[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            if store_sum:
                tl.store(sum_rows + ks[None, :], x, mask=mask)
        x32 = x.to(tl.float32)
        squares += tl.sum(x32 * x32, axis=1)
    return tl.rsqrt(squares / NUM_IN + eps)


@triton.jit
def _walk_k(
    x_rows, r_rows, gamma_ptr, w_rows, acc, first_k, is_row, is_col, inv_rms,
    FIRST_TILE: tl.constexpr, SPAN: tl.constexpr, NUM_IN: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """acc plus the tiles of K from FIRST_TILE on, of the span that starts at `first_k`."""
    for tile in range(FIRST_TILE, tl.cdiv(SPAN, BLOCK_K)):
        ks = first_k + tile * BLOCK_K + tl.arange(0, BLOCK_K)
        is_k = ks < NUM_IN
        x = _input_tile(x_rows, r_rows, gamma_ptr, ks, is_row, is_k, inv_rms, NUM_IN, PROLOGUE,
                        HAS_RESIDUAL)  # fmt: skip
        w = tl.load(w_rows + ks[None, :], mask=is_col[:, None] & is_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    return acc


@triton.jit
def _prefetch_weight(
    w_rows, first_k, SPAN: tl.constexpr, NUM_IN: tl.constexpr, BLOCK_K: tl.constexpr,
    SECTOR: tl.constexpr,
):  # fmt: skip
    """Ask L2 for the program's weight rows over its span of K, one prefetch per SECTOR
    elements (a 32-byte sector), so the tile loads after PDL's wait find them there."""
    sectors = tl.arange(0, BLOCK_K // SECTOR) * SECTOR
    for tile in range(tl.cdiv(SPAN, BLOCK_K)):
        ks = tl.minimum(first_k + tile * BLOCK_K + sectors, NUM_IN - 1)
        prefetch_l2(w_rows + ks[None, :])


@triton.jit
def _few_rows_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    residual_ptr,
    gamma_ptr,
    sum_ptr,
    eps,
    num_rows,
    num_out,
    stride_x,
    stride_residual,
    stride_w,
    NUM_IN: tl.constexpr,  # a model dimension: few values, one compile each
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    SECTOR: tl.constexpr,  # weight elements in 32 bytes: what one L2 prefetch asks for
    PRECISION: tl.constexpr,
    PROLOGUE: tl.constexpr,  # PLAIN, NORM or SILU
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    is_col, is_row = cols < num_out, rows < num_rows
    span: tl.constexpr = NUM_IN // SPLITS  # the host splits only a K of whole tiles
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    x_rows = x_ptr + rows[:, None] * stride_x
    r_rows = residual_ptr + rows[:, None] * stride_residual
    first_k = split * span
    if PDL:
        # NOTE: the weight is asked for before the wait for the kernel before this one
        # (graphguard/kernels/launch.py): no kernel of a step writes a weight, so its round
        # trips overlap that kernel. L2 gets the program's whole share (a row of 16 features
        # reads 2-6 KiB), registers the first tile. Everything else waits, as in a plain launch.
        # A column past the weight's end prefetches its last row, which the program reads anyway.
        prefetch_rows = w_ptr + (tl.minimum(cols, num_out - 1)[:, None]).to(tl.int64) * stride_w
        _prefetch_weight(prefetch_rows, first_k, span, NUM_IN, BLOCK_K, SECTOR)
        ks = first_k + tl.arange(0, BLOCK_K)
        is_k = ks < NUM_IN
        w_first = tl.load(w_rows + ks[None, :], mask=is_col[:, None] & is_k[None, :], other=0.0)
        follow_previous(PDL)
    inv_rms = tl.zeros([ROWS], tl.float32)
    if PROLOGUE == _NORM:
        # every program needs its rows' whole sum; the first stores it for the caller
        store_sum = (block == 0) & (split == 0)
        sum_rows = sum_ptr + rows[:, None] * NUM_IN
        inv_rms = _row_inv_rms(x_rows, r_rows, sum_rows, is_row, eps, store_sum, NUM_IN,
                               BLOCK_K, ROWS, HAS_RESIDUAL)  # fmt: skip
    if PDL:
        x = _input_tile(x_rows, r_rows, gamma_ptr, ks, is_row, is_k, inv_rms, NUM_IN, PROLOGUE,
                        HAS_RESIDUAL)  # fmt: skip
        acc = tl.dot(x, tl.trans(w_first), input_precision=PRECISION)
        acc = _walk_k(x_rows, r_rows, gamma_ptr, w_rows, acc, first_k, is_row, is_col, inv_rms,
                      1, span, NUM_IN, BLOCK_K, PRECISION, PROLOGUE, HAS_RESIDUAL)  # fmt: skip
    else:
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc = _walk_k(x_rows, r_rows, gamma_ptr, w_rows, acc, first_k, is_row, is_col, inv_rms,
                      0, span, NUM_IN, BLOCK_K, PRECISION, PROLOGUE, HAS_RESIDUAL)  # fmt: skip
    mask = is_row[:, None] & is_col[None, :]
    dest = out_ptr + rows[:, None] * num_out + cols[None, :]
    if SPLITS == 1:
        tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        parts = part_ptr + rows[:, None] * num_out + cols[None, :]
        tl.store(parts + split * ROWS * num_out, acc, mask=mask)
        # NOTE: every thread's partial is written before the arrival is counted (the barrier,
        # then a release at GPU scope); the last to arrive acquires them all.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for part in tl.static_range(SPLITS):  # in split order: the same bits every call
                total += tl.load(
                    parts + part * ROWS * num_out, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(dest, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + block, 0, sem="relaxed", scope="gpu")  # the next call's


@triton.jit
def _one_row_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_out,
    stride_w,
    NUM_IN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < num_out
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    # NOTE: the weight's first tile (at 1,024 inputs or fewer, the program's whole share) is
    # loaded before the wait: no kernel of a step writes a weight (graphguard/kernels/launch.py)
    w = tl.load(w_rows + ks[None, :], mask=is_col[:, None] & (ks < NUM_IN)[None, :], other=0.0)
    follow_previous(PDL)
    x = tl.load(x_ptr + ks, mask=ks < NUM_IN, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for tile in tl.static_range(1, (NUM_IN + BLOCK_K - 1) // BLOCK_K):  # unrolled: loads at once
        k = tile * BLOCK_K + ks
        w = tl.load(w_rows + k[None, :], mask=is_col[:, None] & (k < NUM_IN)[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k < NUM_IN, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + cols, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=is_col)


def one_row_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x [1, K] @ weight[N, K].T``, float32 accumulation, without the matrix unit: each
    program owns ONE_ROW_BLOCK_N output features and loads their whole rows of the weight at
    once (tiles of up to 1,024 inputs, unrolled), products summed in float32 per input lane,
    then across lanes. Many small programs with every load in flight: on an H200 a Qwen3-0.6B
    decode layer's four GEMMs took 14.0 us against 20.9 with `few_rows_linear` (run 102,
    docs/kernels.md). Its bits are its own: a row alone here and the same row in a batch of
    2-16 (`few_rows_linear`) agree within float32 rounding of their different sums."""
    if x.dim() != 2 or x.shape[0] != 1 or not can_take(x, weight):
        raise ValueError(f"one_row_linear takes one unit-stride row: {tuple(x.shape)}")
    num_in, num_out = x.shape[1], weight.shape[0]
    out = x.new_empty((1, num_out))
    _one_row_kernel[(triton.cdiv(num_out, ONE_ROW_BLOCK_N),)](
        x, weight, out, num_out, weight.stride(0), NUM_IN=num_in, BLOCK_N=ONE_ROW_BLOCK_N,
        BLOCK_K=min(ONE_ROW_TILE, triton.next_power_of_2(num_in)),
        num_warps=4 if num_in <= ONE_ROW_TILE else 8, num_stages=1, **launch_flags(x.device),
    )  # fmt: skip
    return out


def can_take(x: Tensor, weight: Tensor) -> bool:
    """Whether `few_rows_linear` takes this call (and `one_row_linear`, at one row): 1-16
    rows, unit-stride rows and weight."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and x.dtype == weight.dtype
    )


_COUNTERS: dict[torch.device, Tensor] = {}


def arrival_counters(device: torch.device) -> Tensor:
    """The split launches' arrival counters on `device`: MAX_UNITS zeros, which each launch's
    last arrivals put back to zero.

    NOTE: made on first use, which is eager (graphs capture after eager warm-ups), and kept
    for the process, so a graph's replay finds its counters where its capture left them."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("few_rows_linear's first split launch on a device was captured")
        counters = torch.zeros(MAX_UNITS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def few_rows_linear(x: Tensor, weight: Tensor, plan: LinearPlan | None = None) -> Tensor:
    """``x [M, K] @ weight[N, K].T`` for M <= MAX_ROWS, float32 accumulation; `plan` defaults
    to `plan_linear`'s for the weight (benchmarks and tests try others)."""
    return _launch(x, weight, plan, PLAIN, x.shape[1], None)[0]


def few_rows_norm_linear(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    plan: LinearPlan | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) @ weight.T, x + residual) in one launch: triton_norm's
    `add_rms_norm` (or `rms_norm` without a residual, whose sum is x itself) then
    `few_rows_linear`, the sum and the normed rows rounded where those round. The norm's
    statistics sum the row in K tiles, so they may differ from triton_norm's in the last bit."""
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    norm = (residual, norm_weight, eps)
    return _launch(x, weight, plan, NORM, x.shape[1], norm)


def few_rows_silu_linear(gate_up: Tensor, weight: Tensor, plan: LinearPlan | None = None) -> Tensor:
    """``silu(gate) * up`` of rows ``[M, 2 I]`` (gate, then up) ``@ weight[N, I].T`` in one
    launch: the same bits as triton_mlp's `silu_mul` then `few_rows_linear`."""
    if gate_up.shape[1] != 2 * weight.shape[1]:
        raise ValueError(f"gate/up rows {tuple(gate_up.shape)} do not feed {tuple(weight.shape)}")
    return _launch(gate_up, weight, plan, SILU, weight.shape[1], None)[0]


def _launch(
    x: Tensor,
    weight: Tensor,
    plan: LinearPlan | None,
    prologue: int,
    num_in: int,
    norm: tuple[Tensor | None, Tensor, float] | None,
) -> tuple[Tensor, Tensor]:
    """(the GEMM's output, the norm's residual sum: x itself without a residual sum)."""
    if not can_take(x, weight):
        raise ValueError(f"few_rows_linear takes 1-{MAX_ROWS} unit-stride rows: {x.shape}")
    num_rows, num_out = x.shape[0], weight.shape[0]
    plan = plan_linear(num_in, num_out) if plan is None else plan
    blocks = triton.cdiv(num_out, BLOCK_N)
    if plan.splits > 1 and (num_in % (plan.splits * plan.block_k) or blocks > MAX_UNITS):
        raise ValueError(f"{plan} does not split K={num_in} into whole tiles")
    out = x.new_empty((num_rows, num_out))
    parts = counters = out
    if plan.splits > 1:
        parts = x.new_empty((plan.splits, MAX_ROWS, num_out), dtype=torch.float32)
        counters = arrival_counters(x.device)
    residual, gamma, eps = norm if norm is not None else (None, x, 0.0)
    summed = x if residual is None else x.new_empty((num_rows, num_in))
    _few_rows_kernel[(blocks, plan.splits)](
        x, weight, out, parts, counters, residual if residual is not None else x, gamma, summed,
        eps, num_rows, num_out, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0),
        NUM_IN=num_in, ROWS=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=plan.block_k, SPLITS=plan.splits,
        SECTOR=32 // weight.element_size(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **launch_flags(x.device),
    )  # fmt: skip
    return out, summed
