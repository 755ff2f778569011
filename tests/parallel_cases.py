"""Scenarios that rank 0 of two CPU ranks (gloo, SimBackend) runs for test_parallel.py.

Each runs in a spawned process (so no test process joins a process group) and puts what it saw
on a queue: rank 0's tokens, logits and graph stats, and rank 1's graph stats from shutdown.
"""

from __future__ import annotations

import os
from typing import Any

from graphguard.core.admission import AdmissionConfig
from graphguard.engine.config import EngineConfig, GraphConfig
from graphguard.engine.tokens.sampling import SamplingParams

PROMPT = "The capital of France is"
NUM_TOKENS = 6


def tp_config(**graphs: Any) -> EngineConfig:
    settings = {"backend": "sim", "prefill": False, "background_capture": False}
    settings.update(admission=AdmissionConfig(min_hits=1), batch_buckets=(1, 2))
    return EngineConfig(
        dtype="float32",  # compared with the single-process engine's float32 tokens
        max_model_len=128,
        max_num_seqs=2,
        num_kv_blocks=32,
        tensor_parallel_size=2,
        collective_timeout_s=20.0,
        graphs=GraphConfig(**{**settings, **graphs}),
    )


def greedy_logprobs(engine: Any, prompt: str = PROMPT) -> tuple[list[int], list[float]]:
    """Greedy tokens of `prompt` and each one's log probability."""
    return greedy_ids(engine, engine.tokenizer.encode(prompt), prompt)


def greedy_ids(engine: Any, ids: list[int], name: str) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    engine.add_request(name, ids, params)
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    return tokens, logprobs


def greedy(engine: Any, prompt: str = PROMPT) -> list[int]:
    return greedy_logprobs(engine, prompt)[0]


def run_leader(scenario: str, queue: Any, env: dict[str, str]) -> None:
    """Rank 0 in this process: start both ranks, run `scenario`, report, shut down."""
    from graphguard.engine.launch.spawn import start_ranks

    os.environ.update(env)
    config = SCENARIO_CONFIGS.get(scenario, tp_config)()
    engine, followers = start_ranks(config, FOLLOWERS.get(scenario), LOADERS.get(scenario))
    try:
        report = SCENARIOS[scenario](engine, followers)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        report = {"error": f"{type(exc).__name__}: {exc}"}
    engine.shutdown()
    followers.join(10.0)
    report["follower_reports"] = engine.link.follower_reports
    report["exit_codes"] = [p.exitcode for p in followers.processes]
    queue.put(report)


def generate(engine: Any, followers: Any) -> dict[str, Any]:
    tokens, logprobs = greedy_logprobs(engine)
    stats = engine.graphs.stats() if engine.graphs else None
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "leader": stats,
        "refused": [refusal(engine.reload_weights, {}), refusal(_an_image_request, engine)],
    }


def refusal(call: Any, *args: Any) -> str:
    """The error `call(*args)` raises (what a rank-0 engine refuses under tensor parallelism)."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _an_image_request(engine: Any) -> None:
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request("image", [1, 2, 3], params, images=[torch.zeros(3, 8, 8)])


def covered(engine: Any, followers: Any) -> dict[str, Any]:
    """Two requests earn the 2-row decode graph; then one request's 1-row steps, whose key is
    still earning its own, ride it."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for name in ("a", "b"):
        engine.add_request(name, engine.tokenizer.encode(PROMPT), params)
    while engine.has_unfinished_requests():
        engine.step()
    tokens, logprobs = greedy_logprobs(engine)
    return {"tokens": tokens, "logprobs": logprobs, "leader": engine.graphs.stats()}


def shared_prefix(engine: Any, followers: Any) -> dict[str, Any]:
    """The same long prompt twice: the second prefills from rank 0's prefix cache, and every
    rank reads the blocks it computed for the first."""
    prompt = " ".join([PROMPT] * 4)
    first, second = greedy(engine, prompt), greedy(engine, prompt)
    return {"first": first, "second": second, "prefix_cache": engine.stats()["prefix_cache"]}


def kill_switch_midway(engine: Any, followers: Any) -> dict[str, Any]:
    greedy(engine)
    os.environ["GRAPHGUARD_DISABLE"] = "1"  # rank 0's environment only
    tokens = greedy(engine, "1, 2, 3, 4,")
    return {"tokens": tokens, "leader": engine.graphs.stats()}


def follower_crash(engine: Any, followers: Any) -> dict[str, Any]:
    greedy(engine)
    followers.processes[0].kill()
    followers.processes[0].join(10.0)
    try:
        greedy(engine, "1, 2, 3, 4,")
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def failing_follower(rank: int, setup: Any) -> None:
    """A follower whose captures fail once their function has run (as a CUDA capture that
    fails at its end: its collectives were recorded, so no rank is left waiting)."""
    from graphguard.core.backends import CaptureError
    from graphguard.core.sim import SimBackend
    from graphguard.engine.launch.spawn import follower_main

    original = SimBackend.capture

    def capture(self: SimBackend, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)
        raise CaptureError(f"injected on rank {rank}")

    SimBackend.capture = capture  # type: ignore[method-assign]
    follower_main(rank, setup)


FOLLOWERS = {"capture_fails_on_rank_1": failing_follower}


def random_qwen3() -> Any:
    """Qwen3-0.6B shapes, seeded random bf16 weights, on the CPU (every rank builds the same)."""
    import torch

    from bench.decode import NumberTokenizer
    from graphguard.engine.config import PRESETS
    from graphguard.engine.models import build_model
    from graphguard.engine.models.loader import LoadedModel

    config = PRESETS["qwen3-0.6b"]
    model = build_model(config, dtype=torch.bfloat16, device="cpu", seed=0)
    return LoadedModel("qwen3-0.6b", model, config, NumberTokenizer(config))


def gpu_config() -> EngineConfig:
    graphs = GraphConfig(
        backend="cuda", prefill=False, background_capture=False, batch_buckets=(1, 2, 4)
    )
    return EngineConfig(
        max_model_len=128, max_num_seqs=4, num_kv_blocks=64, tensor_parallel_size=2,
        collective_timeout_s=60.0, kernels="auto", graphs=graphs,
    )  # fmt: skip


def graphs_then_eager(engine: Any, followers: Any) -> dict[str, Any]:
    """The same greedy requests replayed from graphs, then eagerly (rank 0's kill switch)."""
    ids = [11, 22, 33, 44, 55, 66, 77, 88]
    greedy_ids(engine, ids, "earn")  # the key earns its capture (min_hits) here
    graphs = greedy_ids(engine, ids, "graphs")
    os.environ["GRAPHGUARD_DISABLE"] = "1"
    eager = greedy_ids(engine, ids, "eager")
    return {"graphs": graphs, "eager": eager, "leader": engine.graphs.stats()}


def gpu_follower_crash(engine: Any, followers: Any) -> dict[str, Any]:
    ids = [11, 22, 33, 44]
    greedy_ids(engine, ids, "before")
    followers.processes[0].kill()
    followers.processes[0].join(10.0)
    try:
        greedy_ids(engine, ids, "after")
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


LOADERS = {"gpu_graphs_then_eager": random_qwen3, "gpu_follower_crash": random_qwen3}

SCENARIOS = {
    "generate": generate,
    "capture_fails_on_rank_1": generate,
    "small_budget": generate,
    "kill_switch_midway": kill_switch_midway,
    "covered": covered,
    "shared_prefix": shared_prefix,
    "follower_crash": follower_crash,
    "gpu_graphs_then_eager": graphs_then_eager,
    "gpu_follower_crash": gpu_follower_crash,
}
SCENARIO_CONFIGS = {
    "small_budget": lambda: tp_config(max_bytes=1 << 20),
    "covered": lambda: tp_config(admission=AdmissionConfig(min_hits=2)),
    "gpu_graphs_then_eager": gpu_config,
    "gpu_follower_crash": gpu_config,
}
