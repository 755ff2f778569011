"""The decode step's inputs in one host-to-device copy.

A decode step needs five small tensors (token ids, positions, slots, block tables, lengths);
built one by one with ``torch.tensor(..., device=cuda)`` they cost five synchronous copies
(about 30 us each on a busy host). `DecodeInputs` packs them into one pinned host buffer,
copies it with one asynchronous copy into a device buffer it keeps, and hands out views:
int64 ids, positions and slots first, then int32 tables and lengths.

NOTE: the views are valid until the next `pack`: the next copy is ordered after every kernel
that read them (same stream), and the host waits on the last copy's event before it rewrites
the pinned buffer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class DecodeInputs:
    """Persistent pinned host and device buffers for decode inputs, grown on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._is_cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._gpu = torch.empty(0, dtype=torch.uint8, device=device)
        # recorded after each copy; the host waits on it before it rewrites the pinned buffer
        self._copied = torch.cuda.Event() if self._is_cuda else None

    def pack(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(ids, positions, block tables [B, W], lengths, slots) on the device, in the order
        of decode_fn's arguments; `tables` rows are already padded to one width."""
        num_rows, width = len(ids), len(tables[0])
        wide, narrow = 3 * num_rows, num_rows * width + num_rows  # int64s, int32s
        host = self._reserve(8 * wide + 4 * narrow)
        as_i64 = np.frombuffer(host, dtype=np.int64, count=wide)
        as_i32 = np.frombuffer(host, dtype=np.int32, count=narrow, offset=8 * wide)
        as_i64[:] = ids + positions + slots
        as_i32[: num_rows * width].reshape(num_rows, width)[:] = tables
        as_i32[num_rows * width :] = lens
        gpu = self._copy(8 * wide + 4 * narrow)
        i64 = gpu[: 8 * wide].view(torch.int64)
        i32 = gpu[8 * wide : 8 * wide + 4 * narrow].view(torch.int32)
        block_tables = i32[: num_rows * width].view(num_rows, width)
        ids_gpu, positions_gpu, slots_gpu = i64.split(num_rows)
        return ids_gpu, positions_gpu, block_tables, i32[num_rows * width :], slots_gpu

    def _reserve(self, num_bytes: int) -> np.ndarray:
        """The pinned host buffer as numpy bytes, at least `num_bytes` long, free to write."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read it (usually long ago)
        if self._host.numel() < num_bytes:
            size = max(num_bytes, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self._is_cuda)
            self._gpu = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._host.numpy()

    def _copy(self, num_bytes: int) -> Tensor:
        gpu = self._gpu[:num_bytes]
        gpu.copy_(self._host[:num_bytes], non_blocking=self._is_cuda)
        if self._copied is not None:
            self._copied.record()
        return gpu
