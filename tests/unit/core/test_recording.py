"""The recording CPU backend (graphguard/core/recording.py) replays what a capture recorded, not
the step's Python, so it gets wrong what a CUDA graph gets wrong, where the re-running stand-in
(SimBackend(replay="rerun")) answers right and hides the bug."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

import graphguard as gg
from graphguard.core.sim import SimBackend
from graphguard.hf import GraphedCausalLM
from tests.unit.test_hf import EAGER_FIRST, generate, prompt, tiny

RERUN = "rerun"


def backend(replay: str) -> SimBackend:
    return SimBackend(replay=replay)


class Switch:
    """A step whose Python branch and host value are read from attributes its caller sets."""

    def __init__(self) -> None:
        self.negate = False
        self.scale = 2.0
        self.table = torch.ones(4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale + self.table
        return -y if self.negate else y


def replayed_after(change, replay: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A step captured, `change` applied to it by the caller, and its next call: (the answer,
    what eager answers now, the runner's stats)."""
    step = Switch()
    runner = gg.GraphRunner(step, backend=backend(replay), admission=EAGER_FIRST)
    x = torch.arange(4.0)
    runner(x)  # captured
    change(step)
    return runner(x), step(x), runner.stats()


def test_a_python_branch_taken_at_capture_is_replayed_stale_and_rerun_hides_it():
    def flip(step: Switch) -> None:
        step.negate = True

    stale, eager, stats = replayed_after(flip, "record")
    assert stats["replays"] == 2 and torch.equal(stale, -eager)  # the captured branch
    fresh, eager, _ = replayed_after(flip, RERUN)
    assert torch.equal(fresh, eager)


def test_a_host_value_read_at_capture_is_baked_in():
    def rescale(step: Switch) -> None:
        step.scale = 3.0

    stale, eager, _ = replayed_after(rescale, "record")
    assert torch.equal(stale, torch.arange(4.0) * 2.0 + 1) and not torch.equal(stale, eager)
    fresh, eager, _ = replayed_after(rescale, RERUN)
    assert torch.equal(fresh, eager)


def test_a_tensor_rebound_after_capture_is_not_the_one_the_graph_reads():
    def rebind(step: Switch) -> None:
        step.table = torch.zeros(4)  # a new tensor; the graph holds the old one

    stale, eager, _ = replayed_after(rebind, "record")
    assert torch.equal(stale, eager + 1)
    fresh, eager, _ = replayed_after(rebind, RERUN)
    assert torch.equal(fresh, eager)


def test_a_graph_keyed_without_the_active_adapters_is_caught_only_when_recorded(monkeypatch):
    """The bug the recording finds: were the active PEFT adapters not part of a graph's key,
    a graph captured with the adapter would answer with it after the adapter is disabled."""
    model = tiny("qwen3")
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(model, lora).eval()
    with adapted.disable_adapter():
        base = generate(adapted, prompt(1), new=8)
    monkeypatch.setattr(GraphedCausalLM, "adapters", lambda self: None)  # the bug
    answers = {}
    for replay in ("record", RERUN):
        graphed = GraphedCausalLM(adapted, max_cache_len=32, backend=backend(replay),
                                  admission=EAGER_FIRST)  # fmt: skip
        graphed.generate(prompt(1), max_new_tokens=8)  # captured with the adapter on
        with adapted.disable_adapter():
            answers[replay] = graphed.generate(prompt(1), max_new_tokens=8)
    assert torch.equal(answers[RERUN], base)  # re-running the Python hides the stale graph
    assert not torch.equal(answers["record"], base)  # the recording replays it, as CUDA would


def test_a_replay_runs_no_python_of_the_step():
    seen: list[int] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(len(seen))  # unwatched: declared not the step's state
        return x + 1

    capture = gg.CaptureConfig(unwatched=[seen])
    recorded = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST, capture=capture)
    for _ in range(4):
        recorded(torch.zeros(2))
    assert len(seen) == 2  # the record run and the capture; four replays ran none
    rerun = gg.GraphRunner(step, backend=backend(RERUN), admission=EAGER_FIRST, capture=capture)
    for _ in range(4):
        rerun(torch.zeros(2))
    assert len(seen) == 2 + 2 + 4


def test_static_outputs_are_overwritten_by_the_next_replay():
    runner = gg.GraphRunner(lambda x: x * 2, backend="sim", admission=EAGER_FIRST,
                            capture=gg.CaptureConfig(copy_outputs=False))  # fmt: skip
    first = runner(torch.ones(3))
    runner(torch.full((3,), 5.0))
    assert torch.equal(first, torch.full((3,), 10.0))  # a view of the graph's output


def test_a_capture_records_the_ops_and_a_replay_runs_them_into_fixed_tensors():
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ w)
        h.add_(1)  # in place on what the step made
        return h.view(-1)[:3] * 2

    w = torch.randn(4, 4)
    runner = gg.GraphRunner(step, backend="sim", admission=EAGER_FIRST)
    for seed in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(runner(x, w), step(x, w))
    assert runner.stats()["replays"] == 3
