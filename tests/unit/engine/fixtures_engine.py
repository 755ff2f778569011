"""Helpers and fixtures shared by the engine, LLM and detokenize tests.

The model itself comes from conftest.py (``embedded_model``, ``tiny_qwen3``: loaded once per
session); engines built here are cheap and share it. Engine settings are small so that a
step stays fast on a 2-core CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from graphguard.engine.config import engine_config
from graphguard.engine.engine import LLMEngine, RequestOutput
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams

SMALL_ENGINE = {
    "max_num_seqs": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 256,
    "block_size": 4,
    # a lazy start with no graph yet, as these tests expect (test_payback_engine.py prices)
    "price_captures": False,
}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run the module's model steps on one intra-op thread.

    A batch-1 step of the 135M model is a chain of small GEMVs: on a 2-core machine that other
    processes share, two spinning threads made a step 10x slower (600 ms vs 60 ms).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_engine(loaded: LoadedModel, **overrides: Any) -> LLMEngine:
    """An engine with SMALL_ENGINE settings (overridable) on an already loaded model."""
    return LLMEngine(engine_config(**{**SMALL_ENGINE, **overrides}), loaded)


def run_to_completion(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until no request is left; every output, grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def token_ids_of(outputs: list[RequestOutput]) -> list[int]:
    return [token_id for out in outputs for token_id in out.new_token_ids]


def generate_alone(
    loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams, **overrides: Any
) -> list[int]:
    """The tokens a request gets with the engine to itself."""
    engine = make_engine(loaded, **overrides)
    engine.add_request("alone", prompt_ids, params)
    return token_ids_of(run_to_completion(engine)["alone"])
