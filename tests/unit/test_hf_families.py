"""GraphedCausalLM on transformers families beyond Llama and Qwen3 (tests/hf_models.py), on the
recording CPU backend: every step replays a recorded graph, not the step's Python, and the
tokens and the cache are `model.generate`'s own."""

from __future__ import annotations

import pytest
import torch
from transformers import StaticCache

import graphguard as gg
import graphguard.core.single_graphs as single_graphs
from graphguard.core.verify import ParityError
from graphguard.hf import GraphedCausalLM
from tests.hf_models import FAMILIES, OTHER_FAMILIES, tiny_causal_lm
from tests.unit.test_hf import EAGER_FIRST, SHAPE, prompt

NEW = 24  # past every tested window: prompt(rows) is 8 tokens, windows 16


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


def generated(model, ids: torch.Tensor, new: int = NEW) -> tuple[torch.Tensor, StaticCache]:
    """`model.generate`'s greedy tokens, and the static cache it left."""
    cache = StaticCache(config=model.config, max_cache_len=64)
    tokens = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
        do_sample=False, past_key_values=cache,
    )  # fmt: skip
    return tokens, cache


def assert_same_cache(mine, theirs) -> None:
    """Every layer's keys, values, device counter and (sliding layers) Python count alike."""
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        assert type(a) is type(b)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert int(a.cumulative_length) == int(b.cumulative_length)
        counts = [getattr(layer, "cumulative_length_int", None) for layer in (a, b)]
        assert counts[0] == counts[1]


@pytest.mark.parametrize("mode", ["whole", "auto"])
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_every_step_replays_and_leaves_generates_tokens_and_cache(family, mode):
    model = tiny_causal_lm(family, SHAPE)
    expected, their_cache = generated(model, prompt(2))
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST,
                              mode=mode)  # fmt: skip
    assert torch.equal(graphed.generate(prompt(2), max_new_tokens=NEW), expected)
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, NEW - 1, {})
    assert_same_cache(graphed.cache, their_cache)


@pytest.mark.parametrize("family", [f for f in OTHER_FAMILIES if FAMILIES[f].window])
def test_sliding_window_layers_update_in_holes_of_the_graph(family):
    model = tiny_causal_lm(family, SHAPE)
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST)
    graphed.generate(prompt(1), max_new_tokens=4)
    sliding = sum(layer.is_sliding for layer in graphed.cache.layers)
    (entry,) = graphed.runner.entries()
    assert sliding > 0 and graphed.cache.num_holes == sliding == entry.num_holes


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_rejected_capture_leaves_the_cache_and_python_count_of_one_eager_step(
    family, monkeypatch
):
    model = tiny_causal_lm(family, SHAPE)
    expected, their_cache = generated(model, prompt(1), new=20)
    monkeypatch.setattr(single_graphs, "parity_error", lambda *a: ParityError("forced"))
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=20), expected)
    assert graphed.runner.stats()["parity_mismatches"] >= 1
    assert_same_cache(graphed.cache, their_cache)


def test_auto_mode_without_segments_names_why_and_still_replays_whole_steps():
    model = tiny_causal_lm("granite", SHAPE)
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", mode="auto")
    assert graphed.segments is None
    assert "not cut like a Llama decoder layer" in str(graphed.segments_refused)
    with pytest.raises(ValueError, match="not cut like a Llama"):
        GraphedCausalLM(model, max_cache_len=64, backend="sim", mode="segmented")


def test_the_whole_step_of_a_cache_without_holes_is_refused_with_its_reason():
    model = tiny_causal_lm("mistral", SHAPE)
    expected, _ = generated(model, prompt(1), new=6)
    cache = StaticCache(config=model.config, max_cache_len=64)  # transformers' own: no holes
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST)
    graphed.cache = graphed.caches[1] = cache
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=6), expected)
    assert graphed.runner.stats()["fallbacks"] == {"python_state": 5}


def test_a_second_prompt_replays_the_graphs_of_the_first_over_the_reset_cache():
    model = tiny_causal_lm("gemma2", SHAPE)
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST)
    for seed in (1, 2):
        ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(seed))
        expected, _ = generated(model, ids)
        assert torch.equal(graphed.generate(ids, max_new_tokens=NEW), expected)
    stats = graphed.runner.stats()
    assert stats["captures"] == 1 and stats["replays"] == 2 * (NEW - 1)


def test_eager_steps_of_a_family_are_its_own_forward_without_graphs():
    model = tiny_causal_lm("olmo2", SHAPE)
    expected, _ = generated(model, prompt(3), new=6)
    eager = GraphedCausalLM(model, max_cache_len=64, backend="sim",
                            capture=gg.CaptureConfig(enabled=False))  # fmt: skip
    assert torch.equal(eager.generate(prompt(3), max_new_tokens=6), expected)
    assert eager.runner.stats()["fallbacks"] == {"disabled": 5}
