"""Tensor parallelism on two GPUs: NCCL, CudaBackend, all-reduces captured in the decode graph.

Rank 0 runs in a spawned process (tests/parallel_cases.py) and starts rank 1 as the server
does. Skipped without two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel_cases import NUM_TOKENS
from tests.unit.engine.test_parallel import run_scenario

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_replayed_tensor_parallel_decode_is_bitwise_eager_tensor_parallel_decode():
    report = run_scenario("gpu_graphs_then_eager")
    assert "error" not in report, report.get("error")
    assert report["graphs"] == report["eager"]  # tokens and logprobs, exactly
    (follower,) = report["follower_reports"]
    for stats in (report["leader"], follower):
        assert stats["captures"] >= 1 and stats["replays"] >= NUM_TOKENS - 1
        assert stats["fallbacks"].get("kill_switch") == NUM_TOKENS - 1
    assert report["leader"]["fallbacks"] == follower["fallbacks"]


def test_rank_1_crash_ends_rank_0_with_a_clear_error_on_nccl():
    report = run_scenario("gpu_follower_crash")
    assert report["error"] is not None and "RanksLost" in report["error"]
