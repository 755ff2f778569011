"""LLMEngine lifecycle: request validation, KV sizing, locking, reload and shutdown.

These run on a private tiny random model (the embedded tokenizer, random weights), so they may
change its weights and release its KV without touching the shared embedded model.
"""

from __future__ import annotations

import threading

import pytest
import torch

from graphguard.engine.config import (
    STEP_TOKENS,
    STEP_TOKENS_LARGE_GPU,
    EngineConfig,
    step_token_budget,
)
from graphguard.engine.engine import LLMEngine, resolve_device, resolve_dtype
from graphguard.engine.models import build_model
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams
from tests.tiny import tiny_config
from tests.unit.engine.fixtures_engine import (
    GREEDY,
    SMALL_ENGINE,
    make_engine,
    run_to_completion,
)

TINY = tiny_config(vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=512)


@pytest.fixture
def tiny(embedded_model: LoadedModel) -> LoadedModel:
    model = build_model(TINY, dtype=torch.float32, device="cpu", seed=0)
    return LoadedModel("tiny", model, TINY, embedded_model.tokenizer)


@pytest.fixture
def engine(tiny: LoadedModel) -> LLMEngine:
    return make_engine(tiny)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "empty"),
        ([5] * 64, GREEDY, "max_model_len"),
        ([5], SamplingParams(max_tokens=-1), "max_tokens"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(temperature=101.0), "temperature"),
        ([5], SamplingParams(temperature=float("nan")), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(top_p=float("nan")), "top_p"),
        ([5], SamplingParams(top_k=-1), "top_k"),
        ([10**6], GREEDY, "token ids"),
        ([5, -1], GREEDY, "token ids"),
        ([5, 2**70], GREEDY, "token ids"),  # past int64
        ([5, 6.0], GREEDY, "token ids"),  # not an integer
    ],
)
def test_bad_request_raises_value_error_naming_the_problem(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_raises_value_error(engine: LLMEngine) -> None:
    engine.add_request("r", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", [7], GREEDY)


def test_request_larger_than_the_whole_kv_pool_is_refused(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, num_kv_blocks=3)  # 2 usable blocks of 4 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("r", [5] * 6, SamplingParams(max_tokens=8))


def test_kv_pool_is_sized_from_max_num_seqs_and_max_model_len(engine: LLMEngine) -> None:
    blocks_per_seq = SMALL_ENGINE["max_model_len"] // SMALL_ENGINE["block_size"]
    assert engine.stats()["kv_blocks_total"] == SMALL_ENGINE["max_num_seqs"] * blocks_per_seq


def test_auto_device_and_dtype_follow_cuda_availability() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_config_refuses_a_token_budget_below_max_num_seqs() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    # A budget below max_model_len is fine: long prompts are prefilled in chunks.
    EngineConfig(max_model_len=4096, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=-1)


def test_the_default_step_budget_follows_the_device_memory() -> None:
    default = EngineConfig()
    assert default.max_num_batched_tokens == 0  # left to the device
    assert step_token_budget(default, None) == STEP_TOKENS  # a CPU
    assert step_token_budget(default, 40 << 30) == STEP_TOKENS  # a smaller GPU
    assert step_token_budget(default, 141 * 10**9) == STEP_TOKENS_LARGE_GPU  # an H200
    assert STEP_TOKENS_LARGE_GPU > STEP_TOKENS
    # every running sequence's decode token still fits a step
    assert step_token_budget(EngineConfig(max_num_seqs=8192), None) == 8192
    # a budget the config names is the budget, on any device
    assert step_token_budget(EngineConfig(max_num_batched_tokens=512), 141 * 10**9) == 512


def test_the_engine_runs_the_step_budget_it_resolved(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, max_num_batched_tokens=0)
    try:
        assert engine.step_tokens == STEP_TOKENS  # a CPU's
        assert engine.scheduler.max_num_batched_tokens == STEP_TOKENS
    finally:
        engine.shutdown()


def test_step_waits_for_the_lifecycle_lock(engine: LLMEngine) -> None:
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=1))
    stepped = threading.Event()

    def step_then_signal() -> None:
        engine.step()
        stepped.set()

    worker = threading.Thread(target=step_then_signal)
    with engine.lifecycle_lock:
        worker.start()
        assert not stepped.wait(0.2)
    worker.join(timeout=10)
    assert stepped.is_set()


def test_reload_swaps_in_the_new_weights(engine: LLMEngine) -> None:
    old_state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new_state = {k: v + 1.0 for k, v in old_state.items()}
    engine.reload_weights(new_state)
    assert torch.equal(engine.model.norm.weight, new_state["norm.weight"])
    engine.reload_weights(old_state)
    assert torch.equal(engine.model.norm.weight, old_state["norm.weight"])


def test_shutdown_releases_kv_and_frees_every_request(engine: LLMEngine) -> None:
    engine.add_request("r", [5, 6, 7], GREEDY)
    engine.step()
    engine.shutdown()
    assert engine.kv.is_released
    assert engine.stats()["num_running"] == 0 and not engine.has_unfinished_requests()


def test_shutdown_twice_is_harmless_and_later_steps_refuse(engine: LLMEngine) -> None:
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("r", [5], GREEDY)


def test_shutdown_closes_the_installed_graphs(engine: LLMEngine) -> None:
    closed: list[bool] = []

    class Graphs:
        def close(self) -> None:
            closed.append(True)

    engine.graphs = Graphs()
    engine.shutdown()
    assert closed == [True] and engine.graphs is None


def test_abort_of_a_waiting_request_reports_abort_without_running_it(
    engine: LLMEngine,
) -> None:
    engine.add_request("r", [5, 6], GREEDY)
    engine.abort_request("r")
    outputs = run_to_completion(engine)["r"]
    assert [(o.finish_reason, o.num_output_tokens) for o in outputs] == [("abort", 0)]
    assert engine.stats()["num_steps"] == 0


def test_a_failing_step_aborts_its_batch_and_frees_the_blocks(engine: LLMEngine) -> None:
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.step()  # prefill

    def broken(*args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device lost")

    working = engine.forward.decode
    engine.forward.decode = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.kv.num_used_blocks == 0
    engine.forward.decode = working  # type: ignore[method-assign]
    [out] = engine.step()
    assert out.request_id == "a" and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()
