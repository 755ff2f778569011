"""Parity of a graph's outputs against eager's (graphguard/core/verify.py): what counts as equal
in each mode, how far two outputs are apart, and the log line that says where they differ."""

from __future__ import annotations

import math

import pytest
import torch

from graphguard.core.keys import GraphKey
from graphguard.core.verify import (
    VerifyConfig,
    describe_mismatch,
    max_abs_diffs,
    outputs_match,
    parity_error,
    spread_error,
)

KEY = GraphKey(("step",))
EXACT = VerifyConfig()
NAN = float("nan")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values)


def test_exact_parity_is_bitwise_and_a_nan_equals_the_same_nan():
    assert outputs_match((t(1.0, NAN),), (t(1.0, NAN),), EXACT)
    assert not outputs_match((t(1.0, 2.0),), (t(1.0, 2.0 + 1e-6),), EXACT)
    assert not outputs_match(t(0.0), t(-0.0), EXACT)  # equal values, other bits


def test_every_output_leaf_and_the_structure_are_compared():
    assert not outputs_match((t(1.0), t(2.0)), (t(1.0), t(3.0)), EXACT)
    assert not outputs_match((t(1.0),), [t(1.0)], EXACT)  # another structure
    assert not outputs_match(t(1.0, 2.0), t(1.0, 2.0).double(), EXACT)
    assert not outputs_match(t(1.0, 2.0), t(1.0, 2.0)[None], EXACT)
    assert outputs_match((t(1.0), 3), (t(1.0), 3), EXACT) and not outputs_match(3, 4, EXACT)
    assert not outputs_match((t(1.0),), ("x",), EXACT)  # a tensor where eager had a constant
    assert outputs_match((t(),), (t(),), EXACT)  # empty tensors are equal


def test_allclose_admits_within_its_tolerances_only():
    close = VerifyConfig("allclose", rtol=0.0, atol=0.1)
    assert outputs_match(t(1.0), t(1.05), close) and not outputs_match(t(1.0), t(1.2), close)
    relative = VerifyConfig("allclose", rtol=0.1, atol=0.0)
    assert outputs_match(t(10.0), t(10.5), relative) and not outputs_match(t(1.0), t(1.5), relative)
    assert outputs_match(t(NAN), t(NAN), close)
    with pytest.raises(ValueError, match="rtol and atol"):
        VerifyConfig("allclose", rtol=0.1)


def test_a_config_refuses_unknown_modes_and_negative_periods():
    with pytest.raises(ValueError, match="verify must be one of"):
        VerifyConfig("close")
    with pytest.raises(ValueError, match="reverify_every"):
        VerifyConfig(reverify_every=-1)
    with pytest.raises(ValueError, match="^verify='allclose' needs explicit rtol and atol$"):
        VerifyConfig("allclose", rtol=1e-3)
    assert not VerifyConfig("off").enabled and EXACT.enabled


def test_max_abs_diffs_per_leaf():
    graph = (t(1.0), t(1.0, 5.0), "name", t(NAN), t(NAN), t(), "x", t(1.0))
    eager = (t(1.0, 2.0), t(1.5, 3.0), "name", t(NAN), t(2.0), t(), t(1.0), t(3.0))
    diffs = max_abs_diffs(graph, eager)
    assert diffs == [math.inf, 2.0, 0.0, math.inf, 0.0, 2.0]


def test_outputs_of_other_lengths_are_a_programming_error_where_structure_is_not_checked():
    with pytest.raises(ValueError):
        max_abs_diffs((t(1.0), t(2.0)), (t(1.0),))
    with pytest.raises(ValueError):
        spread_error(KEY, (t(1.0), t(2.0)), (t(1.0), t(2.0)), [0.0])


def test_max_abs_diffs_of_another_dtype_is_infinite():
    assert max_abs_diffs(t(1.0), t(1.0).double()) == [math.inf]


def test_spread_error_names_each_output_farther_than_eagers_spread():
    assert spread_error(KEY, (t(1.0), t(2.0)), (t(1.1), t(2.0)), [0.25, 0.0]) is None
    error = spread_error(KEY, (t(1.0), t(2.0)), (t(1.5), t(2.5)), [0.25, 0.5])
    assert error is not None
    assert str(error) == (
        f"graph output outside eager's spread for {KEY.describe()}: out0: max |diff| 0.5 > "
        "eager's spread 0.25"
    )
    both = spread_error(KEY, (t(1.0), t(2.0)), (t(1.5), t(3.0)), [0.25, 0.5])
    assert str(both).endswith("spread 0.25; out1: max |diff| 1 > eager's spread 0.5")


def test_a_mismatch_says_which_output_how_many_elements_in_how_many_rows_and_how_far():
    graph = (t(1.0, 2.0), torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]))
    eager = (t(1.0, 2.0), torch.tensor([[1.5, 2.5, 3.0], [3.0, 4.0, 5.0]]))
    assert describe_mismatch(graph, eager) == "out1: 2/6 elements in 1 rows, max |diff| 0.5"


def test_every_differing_output_is_described_past_the_ones_skipped():
    graph = ("name", t(1.0), t(1.0, 2.0), "x", t(5.0), t(7.0))
    eager = ("name", "y", t(1.0), t(1.0), t(6.0), t(9.0))
    assert describe_mismatch(graph, eager) == (
        "out2: (2,)/torch.float32 vs (1,)/torch.float32; out4: 1/1 elements in 1 rows, "
        "max |diff| 1; out5: 1/1 elements in 1 rows, max |diff| 2"
    )
    assert describe_mismatch((t(1.0), t(2.0)), (t(1.0),)).startswith(
        "the outputs are shaped otherwise"
    )


def test_a_mismatch_of_shapes_dtypes_nans_and_integers_is_described():
    assert (
        describe_mismatch((t(1.0, 2.0),), (t(1.0),))
        == "out0: (2,)/torch.float32 vs (1,)/torch.float32"
    )
    assert (
        describe_mismatch(t(NAN, 1.0), t(NAN, 2.0)) == "out0: 1/2 elements in 1 rows, max |diff| 1"
    )
    assert describe_mismatch(t(NAN), t(1.0)) == "out0: 1/1 elements in 1 rows, max |diff| inf"
    ints = describe_mismatch(torch.tensor([3, 4]), torch.tensor([3, 7]))
    assert ints == "out0: 1/2 elements in 1 rows, max |diff| 3"
    assert describe_mismatch(torch.tensor(2.0), torch.tensor(3.0)).startswith(
        "out0: 1/1 elements in 1 rows"
    )
    assert describe_mismatch((t(1.0), "x"), (t(1.0), "y")) == "no element differs"


def test_complex_outputs_differ_in_their_imaginary_parts_and_a_nan_equals_a_nan():
    graph = torch.tensor([complex(NAN, 0.0), 1 + 1j, 2 + 0j])
    eager = torch.tensor([complex(NAN, 0.0), 1 + 3j, 2 + 0j])
    assert describe_mismatch(graph, eager) == "out0: 1/3 elements in 1 rows, max |diff| 2"
    assert max_abs_diffs(graph, eager) == [2.0]


def test_parity_error_names_the_key_and_the_mismatch():
    assert parity_error(KEY, t(1.0), t(1.0), EXACT) is None
    error = parity_error(KEY, t(1.0, 2.0), t(1.0, 3.0), EXACT)
    assert str(error) == (
        f"graph output differs from eager for {KEY.describe()}: out0: 1/2 elements in 1 rows, "
        "max |diff| 1"
    )


def test_a_reference_kept_on_the_host_compares_with_a_device_output():
    device = torch.device("meta")  # another device than the host's, shapes only
    assert not outputs_match(t(1.0).to(device), t(1.0).double(), EXACT)


def test_distances_are_taken_in_float64_past_the_outputs_own_rounding_and_range():
    # float32 rounds 1e8 - 1 to 1e8; int8 wraps 127 - (-128) to -1; uint8 0 - 255 to 1
    far = (t(1e8), torch.tensor([127], dtype=torch.int8), torch.tensor([0], dtype=torch.uint8))
    near = (t(1.0), torch.tensor([-128], dtype=torch.int8), torch.tensor([255], dtype=torch.uint8))
    assert max_abs_diffs(far, near) == [99999999.0, 255.0, 255.0]
    assert describe_mismatch(far, near) == (
        "out0: 1/1 elements in 1 rows, max |diff| 1e+08; "
        "out1: 1/1 elements in 1 rows, max |diff| 255; out2: 1/1 elements in 1 rows, max |diff| 255"
    )
    rows = torch.zeros(3, 2, 2)
    moved = rows.clone()
    moved[0, 1, 1], moved[2, 0, 0] = 1.0, -2.0
    assert describe_mismatch(moved, rows) == "out0: 2/12 elements in 2 rows, max |diff| 2"
