"""A step's state and transformers models (graphguard/core/state.py, graphguard/hf.py), on the
SimBackend: a capture attempt never changes what the caller observes."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import graphguard as gg
import graphguard.core.single_graphs as single_graphs
from graphguard.core.verify import ParityError
from graphguard.hf import GraphedCausalLM
from tests.hf_models import tiny_causal_lm

EAGER_FIRST = gg.AdmissionConfig(min_hits=1)
SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def tiny(family: str):
    return tiny_causal_lm(family, SHAPE)


def prompt(rows: int) -> torch.Tensor:
    return torch.randint(0, 128, (rows, 8), generator=torch.Generator().manual_seed(rows))


def generate(model, ids: torch.Tensor, new: int = 24) -> torch.Tensor:
    mask = torch.ones_like(ids)
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
        cache_implementation="static",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 4])
def test_graphed_decode_gives_generates_tokens_and_replays(family, rows):
    model = tiny(family)
    expected = generate(model, prompt(rows))
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST)
    assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=24), expected)
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 23, {})


def test_a_capture_leaves_the_cache_as_one_eager_step_left_it():
    eager = GraphedCausalLM(tiny("qwen3"), max_cache_len=32, backend="sim")  # never captures
    graphed = GraphedCausalLM(tiny("qwen3"), max_cache_len=32, backend="sim", admission=EAGER_FIRST)
    for target in (eager, graphed):
        target.generate(prompt(1), max_new_tokens=2)  # the prompt, then one decode step
    assert graphed.runner.stats()["captures"] == 1 and eager.runner.stats()["captures"] == 0
    for mine, theirs in zip(graphed.cache.layers, eager.cache.layers, strict=True):
        assert int(mine.cumulative_length) == int(theirs.cumulative_length) == 9
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_rejected_capture_puts_the_state_back_before_the_eager_answer(monkeypatch):
    model = tiny("llama")
    expected = generate(model, prompt(1), new=6)

    def mismatch(key, graph_out, eager_out, config):
        return ParityError("forced")

    monkeypatch.setattr(single_graphs, "parity_error", mismatch)
    graphed = GraphedCausalLM(model, max_cache_len=32, backend="sim", admission=EAGER_FIRST)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=6), expected)
    stats = graphed.runner.stats()
    assert stats["parity_mismatches"] == 1 and stats["replays"] == 0


class Counter:
    """A step's state outside its arguments: a device counter and a cache it writes."""

    def __init__(self) -> None:
        self.count = torch.zeros(1, dtype=torch.int64)
        self.cache = torch.zeros(8, 4)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, self.count, x)  # the row at the counter
        self.count.add_(1)
        return self.cache.sum(0) + self.count


def drive(runner, counter: Counter, calls: int = 4) -> list[torch.Tensor]:
    return [runner(torch.full((1, 4), float(i + 1))) for i in range(calls)]


def test_a_step_with_state_replays_and_its_state_advances_once_a_call():
    eager, graphed = Counter(), Counter()
    runner = gg.GraphRunner(graphed.step, backend="sim", admission=EAGER_FIRST)
    expected = [eager.step(torch.full((1, 4), float(i + 1))) for i in range(4)]
    got = drive(runner, graphed)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert torch.equal(graphed.cache, eager.cache) and int(graphed.count) == 4
    assert runner.stats()["replays"] == 4  # the capture's first replay answered the first call


def test_a_declared_state_that_misses_a_write_is_refused():
    counter = Counter()
    capture = gg.CaptureConfig(state=[counter.cache])  # the counter is written too
    runner = gg.GraphRunner(counter.step, backend="sim", admission=EAGER_FIRST, capture=capture)
    drive(runner, counter)
    assert runner.stats()["fallbacks"] == {"undeclared_state": 4}
    assert int(counter.count) == 4  # each call ran once


def test_a_state_too_large_to_save_is_refused_and_runs_once_a_call():
    counter = Counter()
    capture = gg.CaptureConfig(max_state_bytes=8)  # the cache row alone is 16 bytes
    runner = gg.GraphRunner(counter.step, backend="sim", admission=EAGER_FIRST, capture=capture)
    drive(runner, counter)
    assert runner.stats()["fallbacks"] == {"state_too_large": 4}
    assert runner.stats()["state_refusals"] == 1 and int(counter.count) == 4


def test_a_step_that_writes_its_own_inputs_is_refused():
    runner = gg.GraphRunner(lambda x: x.add_(1), backend="sim", admission=EAGER_FIRST)
    x = torch.zeros(3)
    for _ in range(3):
        runner(x)
    assert runner.stats()["fallbacks"] == {"unownable_state": 3}
    assert torch.equal(x, torch.full((3,), 3.0))  # the caller's tensor, once a call


def test_state_kept_in_python_objects_is_refused_and_the_step_ran_once():
    kept: list[torch.Tensor] = [torch.zeros(0, 4)]

    def grow(x: torch.Tensor) -> torch.Tensor:  # a cache that grows by concatenation
        kept[0] = torch.cat([kept[0], x])
        return kept[0].sum(0)

    runner = gg.GraphRunner(grow, backend="sim", admission=EAGER_FIRST)
    outs = [runner(torch.ones(1, 4)) for _ in range(3)]
    assert [float(o[0]) for o in outs] == [1.0, 2.0, 3.0]
    assert kept[0].shape == (3, 4)
    assert runner.stats()["fallbacks"] == {"python_state": 3}


def test_a_peft_adapter_changes_the_tokens_and_its_graphs_follow_it():
    model = tiny("qwen3")
    base = generate(model, prompt(1), new=12)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(model, lora).eval()
    with_adapter = generate(adapted, prompt(1), new=12)
    assert not torch.equal(base, with_adapter)
    graphed = GraphedCausalLM(adapted, max_cache_len=32, backend="sim", admission=EAGER_FIRST)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    with adapted.disable_adapter():  # another Python path: another graph, never the stale one
        assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), base)
    assert graphed.runner.stats()["captures"] == 2
    for module in adapted.modules():  # new adapter weights, in place: the graphs read them
        if hasattr(module, "lora_B") and "default" in module.lora_B:
            module.lora_B["default"].weight.data.mul_(-1.0)
    flipped = generate(adapted, prompt(1), new=12)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), flipped)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.7, top_k=20), dict(temperature=1.0, top_k=0, top_p=0.8)]
)
def test_sampled_tokens_equal_generates_under_the_same_seed(sampling):
    model, ids = tiny("qwen3"), prompt(2)
    torch.manual_seed(5)
    expected = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=True,
        cache_implementation="static", **sampling,
    )  # fmt: skip
    graphed = GraphedCausalLM(model, max_cache_len=64, backend="sim", admission=EAGER_FIRST)
    torch.manual_seed(5)
    assert torch.equal(
        graphed.generate(ids, max_new_tokens=16, do_sample=True, **sampling), expected
    )
    assert graphed.runner.stats()["replays"] == 15


def test_one_graphed_model_serves_several_batch_sizes_each_over_its_own_cache():
    model = tiny("llama")
    expected = {rows: generate(model, prompt(rows), new=6) for rows in (1, 4)}
    graphed = GraphedCausalLM(model, max_cache_len=32, backend="sim", admission=EAGER_FIRST)
    for rows in (1, 4, 1):
        assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=6), expected[rows])
    assert sorted(graphed.caches) == [1, 4]
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (2, 15, {})


def test_batch_buckets_pad_rows_so_one_graph_serves_several_batch_sizes():
    model = tiny("qwen3")
    graphed = GraphedCausalLM(model, max_cache_len=32, backend="sim", admission=EAGER_FIRST,
                              batch_buckets=(4,))  # fmt: skip
    for rows in (3, 4, 2):
        ids = prompt(rows)
        padded = torch.cat([ids, ids[-1:].expand(4 - rows, -1)])
        expected = generate(model, padded, new=6)[:rows]
        assert torch.equal(graphed.generate(ids, max_new_tokens=6), expected)
    assert list(graphed.caches) == [4]
    stats = graphed.runner.stats()
    assert (stats["captures"], stats["replays"]) == (1, 15)
