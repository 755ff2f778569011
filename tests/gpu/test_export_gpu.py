"""Manifests on a real CUDA device: the decoder step's node inventory, prewarm, lifetimes.

Run through tools/gpu-check (which pins CUBLAS_WORKSPACE_CONFIG for bitwise parity).
"""

from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest
import torch

import graphguard as gg
from bench.decoder_step import SHAPES, DecoderStep, step_inputs
from graphguard.core.inventory import load_bindings

# Before cuBLAS starts: the same kernels on every stream, so replays equal eager bitwise.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.gpu
needs_bindings = pytest.mark.skipif(isinstance(load_bindings(), str), reason="needs cuda.bindings")
EAGER_FIRST = gg.AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)
SHAPE = SHAPES["smollm2-135m"]
BATCHES = (1, 8)
CONTEXT = 256
# cuBLAS / cuBLASLt / CUTLASS kernel names on Hopper; a batch-1 matmul may run as a GEMV.
GEMM_NAMES = ("gemm", "gemv", "sm90", "cutlass", "nvjet", "xmma")
# The decoder step runs SDPA's math backend: its attention is a softmax between two bmm.
ATTENTION_NAMES = ("softmax", "attention", "fmha")


@pytest.fixture(scope="module")
def step() -> DecoderStep:
    device = torch.device("cuda", torch.cuda.current_device())
    return DecoderStep(
        SHAPE, max_batch=max(BATCHES), context=CONTEXT, dtype=torch.bfloat16, device=device
    )


def batch(step: DecoderStep, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return step_inputs(rows, CONTEXT, step.k_cache.device, seed=seed, vocab=SHAPE.vocab)


def decoder_runner(step: DecoderStep, **kwargs) -> gg.GraphRunner:
    kwargs.setdefault("admission", EAGER_FIRST)
    return gg.GraphRunner(
        step, buckets=gg.Buckets(batch=BATCHES), max_bytes=8 << 30, name="decoder", **kwargs
    )


@pytest.fixture(scope="module")
def captured(step):
    runner = decoder_runner(step)
    for rows in BATCHES:
        runner(*batch(step, rows))
    assert sorted(k.rows for k in runner.admitted_keys()) == list(BATCHES), runner.stats()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def manifest(captured, tmp_path_factory):
    path = tmp_path_factory.mktemp("manifest") / "decoder.json"
    return path, captured.export(path)


def kernel_names(graph: dict) -> list[str]:
    inventory = graph["inventory"]
    assert inventory["available"], inventory
    return [name.lower() for name in inventory["kernels"]]


@needs_bindings
def test_manifest_lists_the_gemm_kernels_of_the_decoder_step(manifest):
    _, data = manifest
    for graph in data["graphs"]:
        names = kernel_names(graph)
        assert any(p in n for n in names for p in GEMM_NAMES), (graph["key_text"], names)


@needs_bindings
def test_manifest_lists_the_attention_kernel_of_the_decoder_step(manifest):
    _, data = manifest
    for graph in data["graphs"]:
        names = kernel_names(graph)
        assert any(p in n for n in names for p in ATTENTION_NAMES), (graph["key_text"], names)


@needs_bindings
def test_node_counts_match_cuda_graph_get_nodes(captured, manifest):
    _, data = manifest
    cudart, _ = load_bindings()
    by_key = {g["key_text"]: g["inventory"] for g in data["graphs"]}
    for entry in captured._cache.entries():
        handle = cudart.cudaGraph_t(init_value=entry.graph.raw_cuda_graph())
        err, _, count = cudart.cudaGraphGetNodes(handle, 0)
        assert err == cudart.cudaError_t.cudaSuccess
        inventory = by_key[entry.key.describe()]
        assert inventory["num_nodes"] == count > 100  # hundreds of small kernels per step
        assert sum(inventory["node_types"].values()) == count
        assert sum(inventory["kernels"].values()) == inventory["node_types"]["kernel"]


def test_export_leaves_the_graphs_replaying_equal_to_eager(step, captured, manifest):
    num_captures = captured.stats()["captures"]
    for rows in BATCHES:
        ids, pos = batch(step, rows, seed=20 + rows)
        got = captured(ids, pos)
        assert torch.equal(got, step(ids, pos))
    assert captured.stats()["captures"] == num_captures


def test_prewarm_from_the_manifest_gives_the_same_keys(step, captured, manifest):
    path, _ = manifest
    fresh = decoder_runner(step, admission=gg.AdmissionConfig(min_hits=1000))
    try:
        report = fresh.prewarm(path, progress=False)
        assert report.refused is None and report.skipped == {}, report
        assert set(fresh.admitted_keys()) == set(captured.admitted_keys())
    finally:
        fresh.close()


def test_prewarmed_graphs_replay_equal_to_eager(step, manifest):
    path, _ = manifest
    fresh = decoder_runner(step, admission=gg.AdmissionConfig(min_hits=1000))
    try:
        fresh.prewarm(path, progress=False)
        captures = fresh.stats()["captures"]
        for rows in BATCHES:  # exact buckets: eager runs the same shapes as the graph
            ids, pos = batch(step, rows, seed=40 + rows)
            got = fresh(ids, pos)
            assert torch.equal(got, step(ids, pos))
        stats = fresh.stats()
        assert stats["captures"] == captures and stats["fallbacks"] == {}, stats
    finally:
        fresh.close()


def pool_bytes_in_snapshot(pool) -> int:
    return sum(
        s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", ())) == tuple(pool)
    )


def test_owner_and_pool_stay_alive_through_export_and_go_on_invalidate(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    box = [torch.randn(512, 512, device=device)]
    runner = gg.GraphRunner(lambda x: torch.relu(x @ box[0]), admission=EAGER_FIRST)
    x = torch.randn(64, 512, device=device)
    runner(x)
    (entry,) = runner._cache.entries()
    entry.retain(box[0])  # the graph reads these weights by address
    ref = weakref.ref(box.pop())
    pool, reserved = entry.pool, pool_bytes_in_snapshot(entry.pool)
    gc.collect()
    runner.export(tmp_path / "m.json")
    gc.collect()
    assert ref() is not None and reserved > 0 and pool_bytes_in_snapshot(pool) == reserved
    weights = ref()
    assert torch.equal(runner(x), torch.relu(x @ weights))  # the graph still reads them
    del weights
    runner.invalidate()  # retire + trim
    gc.collect()
    assert ref() is None and pool_bytes_in_snapshot(pool) == 0


def test_export_while_replays_run_on_another_thread(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(256, 256, device=device)

    def mlp(x, w):
        return torch.tanh(x @ w)

    runner = gg.GraphRunner(mlp, admission=EAGER_FIRST)
    runner(torch.randn(32, 256, device=device), w)
    errors: list[BaseException] = []

    def export_loop() -> None:
        try:
            for i in range(10):
                runner.export(tmp_path / f"m{i}.json")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    exporter = threading.Thread(target=export_loop)
    exporter.start()
    for _ in range(50):
        x = torch.randn(32, 256, device=device)
        assert torch.equal(runner(x, w), mlp(x, w))
    exporter.join(timeout=60)
    assert errors == [] and runner.stats()["fallbacks"] == {}
    runner.close()
