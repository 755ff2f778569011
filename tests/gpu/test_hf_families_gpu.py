"""GraphedCausalLM on transformers families beyond Llama and Qwen3 (tests/hf_models.py) on CUDA
in bfloat16: every decode step replays graphs (sliding-window layers update in holes between
them) and the tokens are `model.generate`'s, with transformers' kernels and with the fused ones."""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import StaticCache  # noqa: E402

import graphguard as gg  # noqa: E402
from graphguard.hf import GraphedCausalLM  # noqa: E402
from tests.gpu.test_hf_gpu import SHAPE, prompt  # noqa: E402
from tests.hf_models import OTHER_FAMILIES, tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.gpu
EAGER_FIRST = gg.AdmissionConfig(min_hits=1)
NEW = 32  # past every tested window: prompts are 16 tokens, windows 32


def generated(model, ids: torch.Tensor) -> tuple[torch.Tensor, StaticCache]:
    """`model.generate`'s greedy tokens (its own forward, not compiled) and the cache it left."""
    cache = StaticCache(config=model.config, max_cache_len=64)
    tokens = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
        do_sample=False, past_key_values=cache, disable_compile=True,
    )  # fmt: skip
    return tokens, cache


@pytest.mark.parametrize("mode", ["whole", "auto"])
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_a_family_replays_every_step_with_generates_tokens_and_cache(family, mode):
    model = tiny_causal_lm(family, SHAPE, device="cuda", dtype=torch.bfloat16)
    expected, theirs = generated(model, prompt(2))
    graphed = GraphedCausalLM(model, max_cache_len=64, admission=EAGER_FIRST, mode=mode)
    assert torch.equal(graphed.generate(prompt(2), max_new_tokens=NEW), expected)
    stats = graphed.runner.stats()
    assert stats["backend"] == "cuda" and stats["fallbacks"] == {}, stats
    assert (stats["captures"], stats["replays"]) == (1, NEW - 1)
    for mine, other in zip(graphed.cache.layers, theirs.layers, strict=True):
        assert torch.equal(mine.keys, other.keys) and torch.equal(mine.values, other.values)
        assert getattr(mine, "cumulative_length_int", 0) == getattr(
            other, "cumulative_length_int", 0
        )
    graphed.close()


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_a_fused_family_replays_the_fused_models_own_tokens(family):
    model = tiny_causal_lm(family, SHAPE, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        own = model(input_ids=prompt(2)).logits.float()
    graphed = GraphedCausalLM(model, max_cache_len=64, admission=EAGER_FIRST, kernels="fused")
    with torch.no_grad():
        fused = model(input_ids=prompt(2)).logits.float()
    # within bfloat16 rounding of the model's own logits (8 bits of mantissa, a few roundings)
    assert float((fused - own).abs().max()) <= 0.05 * float(own.abs().max())
    expected, _ = generated(model, prompt(2))  # generate over the swapped kernels, eagerly
    assert torch.equal(graphed.generate(prompt(2), max_new_tokens=NEW), expected)
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, NEW - 1, {})
    graphed.close()
