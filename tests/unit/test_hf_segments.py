"""Segmented decode steps of transformers models (graphguard/hf_segments.py), on the SimBackend:
graphed norms, MLPs and head, each layer's attention eager between them."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache

from graphguard.hf import GraphedCausalLM
from tests.unit.test_hf import EAGER_FIRST, SHAPE, generate, prompt, tiny


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


def segmented(model, mode: str = "segmented", **options) -> GraphedCausalLM:
    options.setdefault("admission", EAGER_FIRST)
    return GraphedCausalLM(model, max_cache_len=64, backend="sim", mode=mode, **options)


class CountedAttention(torch.nn.Module):
    """An attention that counts its calls in a tensor it replaces on every call: bookkeeping
    held by a Python object, which a graph of the whole step would replay stale."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.attention = attention
        self.calls = torch.zeros((), dtype=torch.int64)

    def forward(self, **kwargs):
        self.calls = self.calls + 1
        return self.attention(**kwargs)


def counted(family: str):
    model = tiny(family)
    for layer in model.model.layers:
        layer.self_attn = CountedAttention(layer.self_attn)
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 4])
def test_segmented_decode_gives_generates_tokens_and_replays(family, rows):
    model = tiny(family)
    expected = generate(model, prompt(rows))
    graphed = segmented(model)
    assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=24), expected)
    assert graphed.segments is not None
    stats = graphed.segments.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 23, {})
    assert stats["num_segments"] == SHAPE["num_hidden_layers"] + 1 and stats["graphs"] == 3
    assert graphed.runner.stats()["calls"] == 0  # no whole step ran


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_segmented_step_gives_the_models_own_logits_and_cache(family):
    model, ids = tiny(family), prompt(2)
    graphed = segmented(model)
    assert graphed.segments is not None
    theirs = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        for cache in (graphed.cache, theirs):
            model(input_ids=ids, past_key_values=cache)
        token = ids[:, -1:]
        for position in range(8, 14):
            expected = model(input_ids=token, past_key_values=theirs).logits[:, -1, :]
            got = graphed.segments.step(token, torch.tensor([position]), None)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            token = expected.argmax(-1, keepdim=True)
    assert graphed.segments.runner.stats()["replays"] == 6
    for mine, other in zip(graphed.cache.layers, theirs.layers, strict=True):
        assert int(mine.cumulative_length) == int(other.cumulative_length) == 14
        torch.testing.assert_close(mine.keys, other.keys, rtol=1e-5, atol=1e-5)


def test_a_segment_capture_leaves_the_cache_as_one_eager_step_left_it():
    eager = segmented(tiny("qwen3"), admission=None)  # never captures: its first call is eager
    graphed = segmented(tiny("qwen3"))
    for target in (eager, graphed):
        target.generate(prompt(1), max_new_tokens=2)  # the prompt, then one decode step
    assert graphed.segments is not None and eager.segments is not None
    assert graphed.segments.runner.stats()["captures"] == 1
    assert eager.segments.runner.stats()["captures"] == 0
    for mine, theirs in zip(graphed.cache.layers, eager.cache.layers, strict=True):
        # the capture ran every attention twice (its graphs, then the eager reference)
        assert int(mine.cumulative_length) == int(theirs.cumulative_length) == 9
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("rows", [1, 3])
def test_auto_takes_segments_where_the_whole_step_keeps_python_state(rows):
    model = counted("llama")
    expected = generate(model, prompt(rows))
    whole = segmented(model, mode="whole")
    assert torch.equal(whole.generate(prompt(rows), max_new_tokens=24), expected)
    assert whole.runner.stats()["fallbacks"] == {"python_state": 23}
    auto = segmented(model, mode="auto")
    assert torch.equal(auto.generate(prompt(rows), max_new_tokens=24), expected)
    assert auto.runner.stats()["fallbacks"] == {"python_state": 1}  # refused once, for good
    assert auto.segments is not None
    stats = auto.segments.runner.stats()
    assert (stats["calls"], stats["captures"], stats["replays"]) == (22, 1, 22)


def test_auto_keeps_whole_step_graphs_where_they_are_not_refused():
    model = tiny("qwen3")
    expected = generate(model, prompt(1))
    auto = segmented(model, mode="auto")
    assert torch.equal(auto.generate(prompt(1), max_new_tokens=24), expected)
    assert auto.runner.stats()["replays"] == 23
    assert auto.segments is not None and auto.segments.runner.stats()["calls"] == 0


def test_a_peft_adapter_switch_keys_the_segment_graphs():
    model = tiny("qwen3")
    base = generate(model, prompt(1), new=12)
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]  # the MLP's are in the segments
    lora = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    adapted = get_peft_model(model, lora).eval()
    with_adapter = generate(adapted, prompt(1), new=12)
    assert not torch.equal(base, with_adapter)
    graphed = segmented(adapted)
    assert graphed.segments is not None
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    with adapted.disable_adapter():  # another Python path: another group, never the stale one
        assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), base)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    stats = graphed.segments.runner.stats()
    assert (stats["captures"], stats["groups"], stats["replays"]) == (2, 2, 33)


def test_segmented_mode_refuses_a_sliding_window_cache():
    config = Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    model = Qwen3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="full-attention"):
        segmented(model)
    GraphedCausalLM(model, max_cache_len=64, backend="sim")  # whole steps still take it


def test_segments_serve_several_batch_sizes_each_over_its_own_cache():
    model = tiny("qwen3")
    expected = {rows: generate(model, prompt(rows), new=6) for rows in (1, 3)}
    graphed = segmented(model)
    for rows in (1, 3, 1):
        assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=6), expected[rows])
    assert sorted(graphed.caches) == [1, 3]
    assert graphed.segments is not None and graphed.segments.runner.stats()["fallbacks"] == {}
