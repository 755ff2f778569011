"""A step's inputs in one host-to-device copy.

A decode step needs five small tensors (token ids, positions, slots, block tables, lengths), a
packed prefill six (the same but query starts for lengths, and its sequences' context lengths);
built one by one with ``torch.tensor(..., device=cuda)`` they cost a synchronous copy each
(about 30 us on a busy host). `DecodeInputs` packs them into one pinned host buffer, copies it
with one asynchronous copy into a device buffer it keeps, and hands out views, each 16-byte
aligned.

NOTE: the views are valid until the next `pack`: the next copy is ordered after every kernel
that read them (same stream), and the host waits on the last copy's event before it rewrites
the pinned buffer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

ALIGN = 16  # bytes: where each view of the packed buffer starts
TORCH_TYPES: dict[type, torch.dtype] = {np.int64: torch.int64, np.int32: torch.int32}


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
        of decode's arguments; `tables` rows are already padded to one width."""
        ids_gpu, positions_gpu, slots_gpu, tables_gpu, lens_gpu = self.pack_arrays(
            [(ids, np.int64), (positions, np.int64), (slots, np.int64), (tables, np.int32),
             (lens, np.int32)]
        )  # fmt: skip
        return ids_gpu, positions_gpu, tables_gpu, lens_gpu, slots_gpu

    def pack_arrays(self, arrays: list[tuple[list | np.ndarray, type]]) -> list[Tensor]:
        """Each (values, numpy integer type) as a device tensor, in one copy: a list of ints
        gives a vector, a list of equal-length lists a matrix, an array its own shape.

        NOTE: each view starts on a 16-byte boundary, whatever the batch. Triton compiles a
        kernel again for a pointer that is not 16-byte aligned: packed end to end, an odd
        batch's views were not, and an eager step of 7 rows compiled the decode attention
        anew, hundreds of ms inside a serving load (docs/benchmarks.md, "Design notes"), after
        a warm-up whose inputs were aligned."""
        shapes = [_shape(values) for values, _ in arrays]
        sizes = [
            np.dtype(kind).itemsize * int(np.prod(shape))
            for (_, kind), shape in zip(arrays, shapes, strict=True)
        ]
        starts = []
        end = 0
        for size in sizes:
            starts.append(end)
            end += -(-size // ALIGN) * ALIGN
        host = self._reserve(end)
        for (values, kind), shape, start in zip(arrays, shapes, starts, strict=True):
            count = int(np.prod(shape))
            np.frombuffer(host, dtype=kind, count=count, offset=start).reshape(shape)[:] = values
        gpu = self._copy(end)
        return [
            gpu[start : start + size].view(TORCH_TYPES[kind]).view(shape)
            for (_, kind), shape, start, size in zip(arrays, shapes, starts, sizes, strict=True)
        ]

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


def _shape(values: list | np.ndarray) -> tuple[int, ...]:
    if isinstance(values, np.ndarray):
        return values.shape
    if values and isinstance(values[0], list):
        return (len(values), len(values[0]))
    return (len(values),)
