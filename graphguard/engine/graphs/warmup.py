"""Captures at start: warm-up of decode keys and of prefill keys, on dummy inputs (as a capture
between steps runs on), largest first, within the budgets."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

from graphguard.core.capture import WarmupReport
from graphguard.core.graph_runner import GraphRunner
from graphguard.engine.models.forward import (
    EagerForward,
    dummy_prefill_inputs,
    padding_decode_batch,
    prefill_inputs,
)
from graphguard.engine.shapes import (
    MIN_PREFILL_TOKENS,
    MIN_WIDTH_BLOCKS,
    POWER_OF_TWO_PREFILL_TOKENS,
    row_widths,
)
from graphguard.segmented import SegmentedRunner
from graphguard.segmented.group import carry_key


def warm_decode(
    runner: GraphRunner, batch_sizes: Iterable[int], widths: Iterable[int], progress: bool = True
) -> WarmupReport:
    """Capture the (batch, width) keys up front, largest first, within the byte budget. The
    warm-up batches are all padding: every row reads and writes only the dummy block."""
    device = runner.backend.device if runner.backend is not None else "cpu"
    examples = [padding_decode_batch(b, w, device) for b in batch_sizes for w in widths]
    return runner.warmup(examples, progress=progress)


def warm_prefill(
    forward: EagerForward,
    rows: GraphRunner | None,
    segmented: SegmentedRunner,
    token_counts: Sequence[int],
    widths: Sequence[int] = (MIN_WIDTH_BLOCKS,),
    progress: bool = True,
    groups: Sequence[int] = (),
) -> WarmupReport:
    """Capture the graphs of prefills of `token_counts` tokens: for a count that can run as
    rows, one key per table width of `widths` at which it can (shapes.py `row_widths`); for
    others, up to POWER_OF_TWO_PREFILL_TOKENS, its group of segments; and the group of each
    count of `groups` (packed at the widths where it cannot run as rows). One report."""
    device = forward.model.embed_tokens.weight.device
    examples: list[tuple[Tensor, ...]] = []
    packed = list(groups)
    for num_tokens in token_counts:
        widths_as_rows = _row_widths(forward, rows, num_tokens, widths)
        examples += [padding_decode_batch(num_tokens, w, device) for w in widths_as_rows]
        if not widths_as_rows and num_tokens <= POWER_OF_TWO_PREFILL_TOKENS:
            packed.append(num_tokens)
    keys = []
    for num_tokens in dict.fromkeys(packed):  # each count once
        ids, positions, meta = dummy_prefill_inputs(num_tokens, forward.kv, device)
        carry = prefill_inputs(forward.model, ids, positions, None, meta)
        keys.append(carry_key(carry))
    report = WarmupReport()
    if rows is not None and examples:
        report = rows.warmup(examples, progress=progress)
    if keys:
        report.add(segmented.warm_keys(keys, progress=progress))
    return report


def warm_whole_prefill(
    forward: EagerForward,
    whole: SegmentedRunner,
    num_tokens: int,
    width: int,
    seq_buckets: Sequence[int],
    progress: bool = True,
) -> WarmupReport:
    """Capture whole prefill graphs of `num_tokens` tokens over tables `width` blocks wide,
    one per sequence bucket of `seq_buckets`, on dummy inputs (one sequence of the tokens over
    the dummy block, empty ones after it): the keys a wave of continued chunks lands on."""
    device = forward.model.embed_tokens.weight.device
    keys = []
    for num_seqs in seq_buckets:
        ids, positions, meta = dummy_prefill_inputs(num_tokens, forward.kv, device, num_seqs, width)
        carry = prefill_inputs(forward.model, ids, positions, None, meta, whole=True)
        keys.append(carry_key(carry))
    return whole.warm_keys(keys, progress=progress)


def prefill_knows_a_price(
    forward: EagerForward, rows: GraphRunner | None, segmented: SegmentedRunner
) -> bool:
    """Whether the runner of the shortest prefills has admitted a capture (payback's price,
    graphguard/core/admission.py)."""
    as_rows = _row_widths(forward, rows, MIN_PREFILL_TOKENS, (MIN_WIDTH_BLOCKS,))
    runner = rows if as_rows and rows is not None else segmented
    return runner.policy.knows_a_price


def _row_widths(
    forward: EagerForward, rows: GraphRunner | None, num_tokens: int, widths: Sequence[int]
) -> list[int]:
    if rows is None:
        return []
    return row_widths(forward.model.kernels, forward.kv.block_size, num_tokens, widths)
