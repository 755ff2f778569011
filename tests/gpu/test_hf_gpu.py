"""transformers models under graphguard on CUDA: a step that writes its cache in place replays
real graphs with every token equal to `model.generate`'s, and no capture changes a token."""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import graphguard as gg  # noqa: E402
import graphguard.core.single_graphs as single_graphs  # noqa: E402
from graphguard.core.verify import ParityError  # noqa: E402
from graphguard.hf import GraphedCausalLM  # noqa: E402
from tests.hf_models import tiny_causal_lm  # noqa: E402

EAGER_FIRST = gg.AdmissionConfig(min_hits=1)
SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
)


def tiny(family: str):
    return tiny_causal_lm(family, SHAPE, device="cuda", dtype=torch.bfloat16)


def prompt(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    return torch.randint(0, SHAPE["vocab_size"], (rows, 16), generator=g).cuda()


def eager_tokens(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    """`model.generate`'s greedy tokens over a static cache, its own forward (not compiled)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=64)
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
        do_sample=False, past_key_values=cache, disable_compile=True,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 8])
def test_hf_decode_replays_graphs_with_eagers_tokens(family, rows):
    model = tiny(family)
    expected = eager_tokens(model, prompt(rows), 32)
    graphed = GraphedCausalLM(model, max_cache_len=64, admission=EAGER_FIRST)
    for _ in range(2):  # the capture's call, then a whole run of replays
        assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=32), expected)
    stats = graphed.runner.stats()
    assert stats["backend"] == "cuda" and stats["captures"] == 1
    assert stats["replays"] == 62 and stats["fallbacks"] == {}
    graphed.close()


def test_a_rejected_capture_changes_no_token_on_cuda(monkeypatch):
    model = tiny("qwen3")
    expected = eager_tokens(model, prompt(1), 12)
    monkeypatch.setattr(single_graphs, "parity_error", lambda *a: ParityError("forced"))
    graphed = GraphedCausalLM(model, max_cache_len=64, admission=EAGER_FIRST)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), expected)
    assert graphed.runner.stats()["parity_mismatches"] == 1
    graphed.close()


def test_reserved_growth_stays_within_the_budget():
    model = tiny("llama")
    eager_tokens(model, prompt(8), 8)  # the eager path's own blocks, cached first
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    budget = 256 << 20
    graphed = GraphedCausalLM(model, max_cache_len=64, max_bytes=budget, admission=EAGER_FIRST)
    graphed.generate(prompt(8), max_new_tokens=8)
    torch.cuda.synchronize()
    assert graphed.runner.stats()["captures"] == 1
    assert torch.cuda.memory_reserved() - before <= budget
    graphed.close()


def test_a_peft_adapter_switch_replays_its_own_graph_on_cuda():
    from peft import LoraConfig, get_peft_model

    model = tiny("qwen3")
    base = eager_tokens(model, prompt(1), 12)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(model, lora).eval()
    with_adapter = eager_tokens(adapted, prompt(1), 12)
    assert not torch.equal(base, with_adapter)
    graphed = GraphedCausalLM(adapted, max_cache_len=64, admission=EAGER_FIRST)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    with adapted.disable_adapter():
        assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), base)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    assert graphed.runner.stats()["captures"] == 2
    graphed.close()


def segmented(model, mode: str = "segmented") -> GraphedCausalLM:
    return GraphedCausalLM(model, max_cache_len=64, admission=EAGER_FIRST, mode=mode)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("rows", [1, 8])
def test_segmented_decode_replays_segment_graphs_with_eagers_tokens(family, rows):
    model = tiny(family)
    expected = eager_tokens(model, prompt(rows), 32)
    graphed = segmented(model)
    for _ in range(2):  # the capture's call, then a whole run of replays
        assert torch.equal(graphed.generate(prompt(rows), max_new_tokens=32), expected)
    assert graphed.segments is not None
    stats = graphed.segments.runner.stats()
    assert stats["backend"] == "cuda" and stats["captures"] == 1
    assert stats["replays"] == 62 and stats["fallbacks"] == {}
    assert stats["graphs"] == SHAPE["num_hidden_layers"] + 1
    graphed.close()


def test_auto_takes_segments_where_the_whole_step_keeps_python_state_on_cuda():
    from tests.unit.test_hf_segments import CountedAttention

    model = tiny("llama")
    for layer in model.model.layers:
        layer.self_attn = CountedAttention(layer.self_attn)
    expected = eager_tokens(model, prompt(8), 32)
    graphed = segmented(model, mode="auto")
    assert torch.equal(graphed.generate(prompt(8), max_new_tokens=32), expected)
    assert graphed.runner.stats()["fallbacks"] == {"python_state": 1}
    assert graphed.segments is not None
    stats = graphed.segments.runner.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 30, {})
    graphed.close()


def test_a_peft_adapter_switch_keys_the_segment_graphs_on_cuda():
    from peft import LoraConfig, get_peft_model

    model = tiny("qwen3")
    base = eager_tokens(model, prompt(1), 12)
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    lora = LoraConfig(r=8, target_modules=targets, init_lora_weights=False)
    adapted = get_peft_model(model, lora).eval()
    with_adapter = eager_tokens(adapted, prompt(1), 12)
    assert not torch.equal(base, with_adapter)
    graphed = segmented(adapted)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    with adapted.disable_adapter():
        assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), base)
    assert torch.equal(graphed.generate(prompt(1), max_new_tokens=12), with_adapter)
    assert graphed.segments is not None
    assert graphed.segments.runner.stats()["captures"] == 2
    graphed.close()
