"""The decode step's inputs in one host-to-device copy.

A decode step needs five small tensors (token ids, positions, slots, block tables, lengths);
built one by one with ``torch.tensor(..., device=cuda)`` they cost five synchronous copies
(about 30 us each on a busy host). `DecodeInputs` packs them into one pinned host buffer,
copies it with one asynchronous copy into a device buffer it keeps, and hands out views:
int64 ids, positions and slots first, then int32 tables and lengths, each 16-byte aligned.

NOTE: the views are valid until the next `pack`: the next copy is ordered after every kernel
that read them (same stream), and the host waits on the last copy's event before it rewrites
the pinned buffer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

ALIGN = 16  # bytes: where each view of the packed buffer starts


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
        of decode's arguments; `tables` rows are already padded to one width.

        NOTE: each view starts on a 16-byte boundary, whatever the batch. Triton compiles a
        kernel again for a pointer that is not 16-byte aligned: packed end to end, an odd
        batch's views were not, and an eager step of 7 rows compiled the decode attention
        anew, hundreds of ms inside a serving load (docs/benchmarks.md, "Design notes"), after
        a warm-up whose inputs were aligned."""
        num_rows, width = len(ids), len(tables[0])
        sizes = (8 * num_rows, 8 * num_rows, 8 * num_rows, 4 * num_rows * width, 4 * num_rows)
        starts = []
        end = 0
        for size in sizes:
            starts.append(end)
            end += -(-size // ALIGN) * ALIGN
        host = self._reserve(end)
        for start, values, dtype in zip(
            starts[:3], (ids, positions, slots), (np.int64,) * 3, strict=True
        ):
            np.frombuffer(host, dtype=dtype, count=num_rows, offset=start)[:] = values
        table_view = np.frombuffer(host, dtype=np.int32, count=num_rows * width, offset=starts[3])
        table_view.reshape(num_rows, width)[:] = tables
        np.frombuffer(host, dtype=np.int32, count=num_rows, offset=starts[4])[:] = lens
        gpu = self._copy(end)

        def view(index: int, dtype: torch.dtype) -> Tensor:
            return gpu[starts[index] : starts[index] + sizes[index]].view(dtype)

        ids_gpu, positions_gpu, slots_gpu = (view(i, torch.int64) for i in range(3))
        block_tables = view(3, torch.int32).view(num_rows, width)
        return ids_gpu, positions_gpu, block_tables, view(4, torch.int32), slots_gpu

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
