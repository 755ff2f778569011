"""graphguard's fused kernels in a transformers model (graphguard/hf_kernels.py), run by Triton's
CPU interpreter: what is swapped, what is left, logits within rounding of the model's own, and
graphs over the fused step that replay and equal its eager run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

import graphguard as gg  # noqa: E402
from graphguard.hf import GraphedCausalLM  # noqa: E402
from graphguard.hf_kernels import (  # noqa: E402
    FusedAttention,
    FusedRMSNorm,
    FusedSwiGLU,
    fuse_kernels,
)
from tests.hf_models import OTHER_FAMILIES, tiny_causal_lm  # noqa: E402
from tests.unit.test_hf import SHAPE, prompt, tiny  # noqa: E402
from tests.unit.test_hf_families import assert_same_cache, generated  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels were imported for the device", allow_module_level=True)


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family,norms", [("qwen3", 2 * 4 + 1), ("llama", 2 * 2 + 1)])
def test_every_norm_and_mlp_is_swapped_and_logits_stay_within_rounding(family, norms):
    model = tiny(family)
    expected = logits(model, prompt(2))
    fusion = fuse_kernels(model)
    kinds = [type(getattr(parent, name)) for parent, name, _ in fusion.swapped]
    counts = (kinds.count(FusedRMSNorm), kinds.count(FusedSwiGLU), kinds.count(FusedAttention))
    assert counts == (norms, 2, 2)
    got = logits(model, prompt(2))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_restore_puts_the_models_own_modules_back():
    model = tiny("qwen3")
    before = [type(m) for m in model.modules()]
    expected = logits(model, prompt(1))
    fusion = fuse_kernels(model)
    assert [type(m) for m in model.modules()] != before
    fusion.restore()
    assert [type(m) for m in model.modules()] == before
    assert torch.equal(logits(model, prompt(1)), expected)


class OnePlusWeightRMSNorm(nn.Module):
    """Gemma's norm: scales by ``1 + weight``, which a plain RMSNorm kernel does not."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def test_a_norm_that_computes_something_else_is_left_as_it_is():
    model = tiny("llama")
    layer = model.model.layers[0]
    layer.input_layernorm = OnePlusWeightRMSNorm(64)
    expected = logits(model, prompt(1))
    fusion = fuse_kernels(model)
    assert isinstance(layer.input_layernorm, OnePlusWeightRMSNorm)
    assert "relative error" in fusion.skipped["OnePlusWeightRMSNorm"]
    assert isinstance(layer.post_attention_layernorm, FusedRMSNorm)
    torch.testing.assert_close(logits(model, prompt(1)), expected, rtol=1e-4, atol=1e-4)


def test_graphs_of_the_fused_step_replay_and_equal_its_eager_run():
    admit_first = gg.AdmissionConfig(min_hits=1)
    eager = GraphedCausalLM(tiny("qwen3"), max_cache_len=32, backend="sim",
                            capture=gg.CaptureConfig(enabled=False), kernels="fused")  # fmt: skip
    graphed = GraphedCausalLM(tiny("qwen3"), max_cache_len=32, backend="sim",
                              admission=admit_first, kernels="fused")  # fmt: skip
    expected = eager.generate(prompt(2), max_new_tokens=8)
    assert torch.equal(graphed.generate(prompt(2), max_new_tokens=8), expected)
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 7, {})
    graphed.close()
    assert not any(isinstance(m, FusedRMSNorm) for m in graphed.model.modules())


def test_an_unknown_kernels_choice_is_refused():
    with pytest.raises(ValueError, match="'model' or 'fused'"):
        GraphedCausalLM(tiny("llama"), max_cache_len=16, backend="sim", kernels="liger")


FUSED_CASES = [(family, "whole") for family in OTHER_FAMILIES] + [
    ("mistral", "auto"),
    ("qwen3_moe", "auto"),
]


@pytest.mark.parametrize("family,mode", FUSED_CASES)
def test_a_fused_family_replays_the_fused_models_own_generate(family, mode):
    model = tiny_causal_lm(family, SHAPE, window=8)  # 8 prompt tokens and 6 new pass a window
    own = logits(model, prompt(2))
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", kernels="fused",
                              admission=gg.AdmissionConfig(min_hits=1), mode=mode)  # fmt: skip
    torch.testing.assert_close(logits(model, prompt(2)), own, rtol=1e-4, atol=1e-4)
    expected, their_cache = generated(model, prompt(2), new=6)  # over the swapped kernels
    assert torch.equal(graphed.generate(prompt(2), max_new_tokens=6), expected)
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 5, {})
    assert_same_cache(graphed.cache, their_cache)
    fusion = graphed.fusion
    assert fusion is not None and fusion.num_swapped + len(fusion.skipped) > 0


@pytest.mark.parametrize(
    "family,module,why,num_fused",
    [
        ("gemma2", "Gemma2Attention", "soft-caps its attention logits", 0),
        ("gemma2", "Gemma2RMSNorm", "computes something else", 0),
        ("smollm3", "SmolLM3Attention", "without RoPE", 1),  # the layer with RoPE is swapped
        ("olmo2", "Olmo2Attention", "computes something else", 0),
    ],
)
def test_a_swap_that_computes_something_else_is_skipped_with_its_reason(
    family, module, why, num_fused
):
    model = tiny_causal_lm(family, SHAPE)
    fusion = fuse_kernels(model)
    assert why in fusion.skipped[module]
    swapped = [original for _, _, original in fusion.swapped]
    assert sum(type(original).__name__ == module for original in swapped) == num_fused


def test_each_module_is_checked_on_its_own_not_by_its_class():
    model = tiny_causal_lm("smollm3", SHAPE)  # layer 1 of 2 has no RoPE, layer 0 has
    fusion = fuse_kernels(model)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn, FusedAttention)
    assert not isinstance(layers[1].self_attn, FusedAttention)
    assert "without RoPE" in fusion.skipped["SmolLM3Attention"]
