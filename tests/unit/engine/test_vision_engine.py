"""Image requests through the engine (embedded model, CPU): splicing and segmented prefill."""

from __future__ import annotations

import pytest
import torch

from graphguard.engine.models.images import expand_image_tokens
from graphguard.engine.scheduling.sequence import Sequence
from graphguard.engine.tokens.sampling import SamplingParams
from graphguard.segmented import SegmentedRunner
from tests.unit.engine.fixtures_engine import (  # noqa: F401
    make_engine,
    one_torch_thread,
    run_to_completion,
    token_ids_of,
)

VISION_ENGINE = {"max_model_len": 128}
# Graphs captured inside the call that earns them: these tests count captures and replays of
# prefills they run directly (no step in between to advance a capture between steps).
GRAPHS_IN_STEP = {"graph_backend": "sim", "background_capture": False}


@pytest.fixture(autouse=True)
def _threads(one_torch_thread, monkeypatch):  # noqa: F811
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


def image(seed: int) -> torch.Tensor:
    return torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def image_prompt(engine, question: str, num_images: int = 1) -> list[int]:
    vision = engine.vision
    marker = vision.config.image_token * num_images
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": marker + question}])
    return expand_image_tokens(ids, vision.image_token_id, vision.num_tokens_per_image, num_images)


def prefill_logits(engine, prompt: list[int], images: list[torch.Tensor]) -> torch.Tensor:
    """Full-vocabulary logits of the prompt's last token, through ModelRunner.prefill."""
    seq = Sequence("probe", prompt, SamplingParams())
    seq.image_embeds, seq.image_positions = engine._embed_images(prompt, images)
    seq.block_table = engine.kv.allocate(-(-len(prompt) // engine.config.block_size))
    try:
        return engine.runner.prefill([seq])[0]
    finally:
        engine.kv.free(seq.block_table)


def generate(engine, requests: dict[str, tuple[list[int], list[torch.Tensor]]]):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for rid, (prompt, images) in requests.items():
        engine.add_request(rid, prompt, params, images=images)
    return {rid: token_ids_of(outs) for rid, outs in run_to_completion(engine).items()}


def test_image_requests_give_the_same_tokens_with_graphs_as_eager(embedded_model):
    eager = make_engine(embedded_model, enforce_eager=True, **VISION_ENGINE)
    graphs = make_engine(embedded_model, **GRAPHS_IN_STEP, **VISION_ENGINE)
    try:
        prompt = image_prompt(eager, "What is shown?")
        for round_ in range(3):  # the same shape three times: captured on the second
            requests = {f"r{round_}": (prompt, [image(round_)])}
            assert generate(graphs, requests) == generate(eager, requests)
        stats = graphs.graphs.stats()["prefill"]
        assert stats["captures"] == 1 and stats["replays"] == 2
    finally:
        eager.shutdown()
        graphs.shutdown()


def test_segmented_prefill_logits_equal_eager_bitwise_with_new_images(embedded_model):
    engine = make_engine(embedded_model, **GRAPHS_IN_STEP, **VISION_ENGINE)
    try:
        prefill = engine.graphs.prefill
        assert isinstance(prefill, SegmentedRunner) and engine.runner.graphs is engine.graphs
        prompt = image_prompt(engine, "Describe it.")
        for seed in range(3):
            graphed = prefill_logits(engine, prompt, [image(seed)])
            engine.runner.graphs = None  # the same step, eagerly
            eager = prefill_logits(engine, prompt, [image(seed)])
            engine.runner.graphs = engine.graphs
            assert torch.equal(graphed, eager)
        assert prefill.stats()["replays"] == 2
    finally:
        engine.shutdown()


def test_the_image_reaches_the_logits(embedded_model):
    engine = make_engine(embedded_model, enforce_eager=True, **VISION_ENGINE)
    try:
        prompt = image_prompt(engine, "Describe it.")
        assert not torch.equal(
            prefill_logits(engine, prompt, [image(0)]), prefill_logits(engine, prompt, [image(1)])
        )
    finally:
        engine.shutdown()


def test_images_without_their_placeholders_are_refused(embedded_model):
    engine = make_engine(embedded_model, enforce_eager=True, **VISION_ENGINE)
    try:
        prompt = engine.tokenizer.encode("No placeholder here")
        with pytest.raises(ValueError, match="placeholder"):
            engine.add_request("a", prompt, SamplingParams(), images=[image(0)])
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_prefill_graphs_follow_the_decode_capability_proof(embedded_model):
    eager = make_engine(embedded_model, enforce_eager=True, graph_backend="sim")
    auto = make_engine(embedded_model)
    try:
        assert eager.graphs is None and eager.runner.graphs is None
        assert auto.graphs is None or torch.cuda.is_available()
    finally:
        eager.shutdown()
        auto.shutdown()


def test_reload_and_shutdown_retire_prefill_groups(embedded_model):
    engine = make_engine(embedded_model, **GRAPHS_IN_STEP, **VISION_ENGINE)
    prompt = image_prompt(engine, "Hi")
    for seed in range(2):
        prefill_logits(engine, prompt, [image(seed)])
    prefill = engine.graphs.prefill
    assert prefill.stats()["groups"] == 1
    engine.reload_weights(engine.model.state_dict())
    assert prefill.stats()["groups"] == 0 and prefill.stats()["evictions"] == 1
    engine.shutdown()
    assert prefill.stats()["closed"] and engine.graphs is None
