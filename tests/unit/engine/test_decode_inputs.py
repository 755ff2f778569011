"""A decode step's inputs in one packed copy (graphguard/engine/step/decode_inputs.py): the values
come back as given, and every view starts on a 16-byte boundary whatever the batch (Triton
compiles a kernel again for a pointer that is not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphguard.engine.step.decode_inputs import DecodeInputs


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("width", [1, 3, 8])
def test_packed_views_hold_the_values_and_are_16_byte_aligned(rows: int, width: int) -> None:
    inputs = DecodeInputs(torch.device("cpu"))
    ids = list(range(rows))
    positions = [10 + i for i in range(rows)]
    slots = [100 + i for i in range(rows)]
    tables = [[1000 * i + j for j in range(width)] for i in range(rows)]
    lens = [5 + i for i in range(rows)]
    for _ in range(2):  # a second pack reuses the buffers
        ids_t, positions_t, tables_t, lens_t, slots_t = inputs.pack(
            ids, positions, slots, tables, lens
        )
        assert ids_t.tolist() == ids and positions_t.tolist() == positions
        assert slots_t.tolist() == slots and lens_t.tolist() == lens
        assert tables_t.tolist() == tables and tables_t.shape == (rows, width)
        assert (ids_t.dtype, tables_t.dtype) == (torch.int64, torch.int32)
        for view in (ids_t, positions_t, tables_t, lens_t, slots_t):
            assert view.data_ptr() % 16 == 0


def test_a_packed_prefills_arrays_come_back_with_their_shapes_types_and_alignment() -> None:
    inputs = DecodeInputs(torch.device("cpu"))
    ids, slots = list(range(5)), [40 + i for i in range(5)]
    tables, lens, starts = [[3, 4, 5], [9, 0, 0]], [3, 2], [0, 3, 5]
    arrays = [(ids, np.int64), (slots, np.int64), (tables, np.int32), (lens, np.int32),
              (starts, np.int32)]  # fmt: skip
    got = inputs.pack_arrays(arrays)
    assert [t.tolist() for t in got] == [ids, slots, tables, lens, starts]
    assert [t.dtype for t in got] == [torch.int64] * 2 + [torch.int32] * 3
    assert got[2].shape == (2, 3) and all(t.data_ptr() % 16 == 0 for t in got)


def test_an_array_packs_with_its_own_shape_next_to_lists() -> None:
    """A packed prefill's block tables come as a numpy array (its padding rows filled at
    once): its shape and values come back, aligned, beside the lists."""
    inputs = DecodeInputs(torch.device("cpu"))
    tables = np.full((4, 3), 7, dtype=np.int32)
    tables[0, :2] = [1, 2]
    got = inputs.pack_arrays([([5, 6, 7], np.int64), (tables, np.int32), ([1], np.int32)])
    assert got[1].shape == (4, 3) and got[1].tolist() == tables.tolist()
    assert got[0].tolist() == [5, 6, 7] and got[2].tolist() == [1]
    assert all(t.data_ptr() % 16 == 0 for t in got)
