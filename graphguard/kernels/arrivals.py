"""Arrival counters for the kernels whose last program to finish a unit of work completes it
(`triton_linear`'s split K, `triton_decode`'s merge of a row's splits): one int32 per unit,
zero between launches, each launch's last arrival putting its unit's back to zero.

NOTE: made on first use, which is eager (graphs capture after eager warm-ups), and kept for the
process, so a graph's replay finds its counters where its capture left them. Launches that
share them run one after another: one stream at a time, as the engine's steps and captures do.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_UNITS = 1 << 16  # units of work one launch may count arrivals for

_COUNTERS: dict[torch.device, Tensor] = {}


def arrival_counters(device: torch.device) -> Tensor:
    """The arrival counters on `device` (MAX_UNITS zeros)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a kernel's first launch with arrival counters was captured")
        counters = torch.zeros(MAX_UNITS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
