"""graphguard's fused kernels in a transformers model on CUDA (graphguard/hf_kernels.py): bfloat16
logits within rounding of the model's own, graphs of the fused step that replay with every token
equal to its eager run, and the model's own modules back after close()."""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import graphguard as gg  # noqa: E402
from graphguard.hf import GraphedCausalLM  # noqa: E402
from graphguard.hf_kernels import FusedRMSNorm, fuse_kernels  # noqa: E402
from tests.gpu.test_hf_gpu import EAGER_FIRST, prompt, tiny  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_logits_stay_within_bfloat16_rounding_of_the_models_own(family):
    model = tiny(family)
    ids = prompt(4)
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
        fusion = fuse_kernels(model)
        got = model(input_ids=ids).logits.float()
    assert fusion.num_swapped > 0 and not fusion.skipped
    error = (got - expected).norm() / expected.norm()
    assert error < 2e-2, f"relative error {float(error):.3g}"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 8])
def test_fused_graphs_replay_with_the_fused_eager_runs_tokens(family, rows):
    model = tiny(family)
    eager = GraphedCausalLM(model, max_cache_len=64, kernels="fused",
                            capture=gg.CaptureConfig(enabled=False))  # fmt: skip
    expected = eager.generate(prompt(rows), max_new_tokens=32)
    eager.close()
    graphed = GraphedCausalLM(model, max_cache_len=64, admission=EAGER_FIRST, kernels="fused")
    assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=32), expected)
    stats = graphed.runner.stats()
    assert stats["replays"] == 31 and stats["fallbacks"] == {}
    graphed.close()
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
