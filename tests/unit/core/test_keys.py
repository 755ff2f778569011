import pytest
import torch

from graphguard.core.inputs import CallPlan, plan_call
from graphguard.core.keys import Buckets, GraphKey, TensorSpec
from graphguard.core.reasons import FallbackReason

CPU = torch.device("cpu")


def test_buckets_sort_and_pad_up_to_the_next_size():
    buckets = Buckets(batch=[8, 1, 4, 2])
    assert buckets.batch == (1, 2, 4, 8)
    assert [buckets.bucket_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_a_shape_above_the_largest_bucket_has_no_bucket():
    assert Buckets(batch=[1, 2]).bucket_for(3) is None


@pytest.mark.parametrize("bad", [[], [0, 1], [-2], [2, 2]])
def test_invalid_bucket_tables_are_rejected_at_construction(bad):
    with pytest.raises(ValueError):
        Buckets(batch=bad)


def test_per_argument_pad_values_are_looked_up_by_position():
    buckets = Buckets(batch=[4], pad_value=(0, 1))
    assert buckets.pad_for(1) == 1
    with pytest.raises(ValueError, match="one pad value per positional argument"):
        buckets.pad_for(2)


def test_call_is_keyed_by_padded_shape_dtype_and_device():
    plan = plan_call(
        (torch.zeros(3, 5), torch.zeros(3, dtype=torch.int64)), Buckets([4]), CPU, False
    )
    assert isinstance(plan, CallPlan)
    assert plan.rows == 3 and plan.padded_rows == 4
    assert plan.key.args == (
        TensorSpec((4, 5), torch.float32, CPU),
        TensorSpec((4,), torch.int64, CPU),
    )


def test_without_buckets_the_key_is_the_exact_shape():
    plan = plan_call((torch.zeros(3, 5), 7), None, CPU, False)
    assert isinstance(plan, CallPlan)
    assert plan.key == GraphKey((TensorSpec((3, 5), torch.float32, CPU), 7), None)


def test_inputs_that_disagree_on_rows_are_unbucketed():
    reason = plan_call((torch.zeros(3, 5), torch.zeros(2, 5)), Buckets([4]), CPU, False)
    assert reason is FallbackReason.UNBUCKETED_SHAPE


def test_unhashable_constant_argument_is_unsupported():
    reason = plan_call((torch.zeros(1), [1, 2]), None, CPU, False)
    assert reason is FallbackReason.UNSUPPORTED_INPUT
