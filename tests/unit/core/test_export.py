"""Manifests (SimBackend on CPU): export, reading, refusal, prewarm, the engine flag, inspect."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import graphguard as gg
from graphguard.cli import main as graphguard_main
from graphguard.core.export import (
    MANIFEST_VERSION,
    export_manifest,
    key_from_json,
    key_to_json,
    read_manifest,
)
from graphguard.core.inventory import NodeInventory, load_bindings, read_inventory
from graphguard.core.keys import GraphKey, TensorSpec
from graphguard.core.prewarm import plan_examples, prewarm
from graphguard.inspect import render
from tests.unit.core.conftest import SEG, inputs, mlp_step

BUCKETS = gg.Buckets(batch=(2, 4, 8), pad_value=(0.5, -1.0))
EAGER_FIRST = gg.AdmissionConfig(min_hits=1, frequency_aware=False)


@pytest.fixture
def captured(make_runner):
    """A runner with graphs for the buckets 8, 4 and 2, each replayed a few times."""
    runner = make_runner(buckets=BUCKETS, admission=EAGER_FIRST, name="mlp")
    for rows in (1, 3, 8, 3, 8, 8):
        runner(*inputs(rows))
    return runner


@pytest.fixture
def manifest_path(captured, tmp_path) -> Path:
    path = tmp_path / "graphs.json"
    captured.export(path)
    return path


def edited(path: Path, edit) -> dict:
    data = json.loads(path.read_text())
    edit(data)
    return data


# -- export --------------------------------------------------------------------------------
def test_manifest_lists_every_resident_graph_with_bytes_parity_and_replays(captured, tmp_path):
    manifest = captured.export(tmp_path / "m.json")
    graphs = {g["rows"]: g for g in manifest["graphs"]}
    assert set(graphs) == {2, 4, 8}
    entry = {e.key.rows: e for e in captured._cache.entries()}[8]
    assert graphs[8]["resident_bytes"] == entry.resident_bytes >= SEG
    assert graphs[8]["replays"] == entry.replays == 3
    assert graphs[8]["parity"] == "exact" and graphs[8]["state"] == "admitted"
    assert graphs[8]["capture_ms"] > 0
    assert graphs[8]["inputs"][0] == {
        "shape": [8, 8],
        "dtype": "float32",
        "stride": [8, 1],
        "device": "cpu",
    }
    assert [o["shape"] for o in graphs[8]["outputs"]] == [[8], [8, 8]]


def test_manifest_is_versioned_json_with_the_environment(manifest_path):
    data = json.loads(manifest_path.read_text())
    assert data["format"] == "graphguard-manifest" and data["version"] == MANIFEST_VERSION
    env = data["environment"]
    assert env["torch"] == torch.__version__ and env["graphguard"] == gg.__version__
    assert (env["backend"], env["device"]) == ("sim", "cpu")
    assert data["runner"]["name"] == "mlp" and data["runner"]["buckets"] == [2, 4, 8]
    assert [g["rows"] for g in data["graphs"]] == [8, 4, 2]  # largest first


def test_keys_round_trip_through_json_with_their_constants():
    spec = TensorSpec((4, 3), torch.bfloat16, torch.device("cpu"))
    key = GraphKey((spec, 3, 0.5, True, None, "mean", (1, (2, "x")), torch.int32), rows=4)
    assert key_from_json(json.loads(json.dumps(key_to_json(key)))) == key


def test_key_with_an_opaque_constant_is_listed_but_skipped_at_prewarm(make_runner, tmp_path):
    def scaled(x, how):
        return x * 2

    runner = make_runner(fn=scaled, admission=EAGER_FIRST)
    runner(torch.ones(2, 2), frozenset({"a"}))
    manifest = runner.export(tmp_path / "m.json")
    fresh = make_runner(fn=scaled, admission=EAGER_FIRST)
    report = fresh.prewarm(manifest, progress=False)
    assert report.captured == [] and "unreadable_key" in next(iter(report.skipped.values()))


def test_sim_graphs_say_why_their_inventory_is_unavailable(manifest_path):
    for graph in json.loads(manifest_path.read_text())["graphs"]:
        assert graph["inventory"] == {
            "available": False,
            "reason": "unavailable: the sim backend has no CUDA graph nodes",
        }


@pytest.mark.skipif(not isinstance(load_bindings(), str), reason="cuda.bindings is installed")
def test_cuda_graph_inventory_without_cuda_bindings_says_so():
    class RawGraph:
        def raw_cuda_graph(self) -> int:
            return 0

    inventory = read_inventory(RawGraph(), "cuda")
    assert inventory.unavailable == (
        "unavailable: cuda.bindings is not installed (pip install cuda-bindings)"
    )


def test_export_neither_resets_nor_recaptures(captured, tmp_path):
    graphs = {e.key: e.graph for e in captured._cache.entries()}
    num_captures = captured.backend.num_captures
    captured.export(tmp_path / "m.json")
    x, pos = inputs(7, seed=3)
    got = captured(x, pos)
    assert captured.backend.num_captures == num_captures
    assert {e.key: e.graph for e in captured._cache.entries()} == graphs
    assert all(torch.equal(a, b) for a, b in zip(got, mlp_step(x, pos), strict=True))


def test_export_pins_every_entry_so_eviction_skips_them(captured, tmp_path):
    cache, evictable = captured._cache, []

    def reader(graph, backend):
        evictable.append(cache.victims_for(cache.max_bytes))  # None: nothing may be evicted
        return read_inventory(graph, backend)

    export_manifest(captured, tmp_path / "m.json", read=reader)
    assert evictable == [None, None, None]
    assert len(cache.victims_for(cache.max_bytes) or []) == 3  # unpinned again


def test_invalidate_during_export_waits_until_the_entry_was_read(make_runner, tmp_path):
    runner = make_runner(admission=EAGER_FIRST)
    runner(*inputs(4))
    (entry,) = runner._cache.entries()
    invalidator = threading.Thread(target=runner.invalidate)
    retired_while_reading = []

    def reader(graph, backend):
        invalidator.start()
        time.sleep(0.2)  # long enough for invalidate to reach the entry's lock
        retired_while_reading.append(entry.is_retired)
        return read_inventory(graph, backend)

    manifest = export_manifest(runner, tmp_path / "m.json", read=reader)
    invalidator.join(timeout=5)
    assert retired_while_reading == [False] and manifest["graphs"][0]["state"] == "admitted"
    assert entry.is_retired and runner.admitted_keys() == []


def test_export_while_replays_run_in_another_thread(captured, tmp_path):
    failures: list[str] = []

    def replay_loop():
        for i in range(40):
            x, pos = inputs(1 + i % 8, seed=i)
            if not torch.equal(captured(x, pos)[1], mlp_step(x, pos)[1]):
                failures.append(f"call {i}")

    worker = threading.Thread(target=replay_loop)
    worker.start()
    for i in range(10):
        captured.export(tmp_path / f"m{i}.json")
    worker.join(timeout=30)
    assert failures == [] and captured.stats()["fallbacks"] == {}


def test_export_writes_the_file_whole_into_new_folders(captured, tmp_path):
    path = tmp_path / "a" / "b" / "graphs.json"
    captured.export(path)
    assert json.loads(path.read_text())["graphs"]
    assert [p.name for p in path.parent.iterdir()] == ["graphs.json"]


# -- refusal -------------------------------------------------------------------------------
def test_manifest_from_another_torch_is_refused_and_the_runner_stays_lazy(
    make_runner, manifest_path
):
    old = edited(manifest_path, lambda d: d["environment"].update(torch="2.11.0+cu130"))
    runner = make_runner(buckets=BUCKETS, admission=EAGER_FIRST)
    report = runner.prewarm(old, progress=False)
    assert report.refused == (
        f"torch: manifest is from torch 2.11.0+cu130; this is {torch.__version__}"
    )
    assert report.captured == [] and runner.admitted_keys() == []
    runner(*inputs(3))
    assert len(runner.admitted_keys()) == 1  # lazy capture still works


def test_manifest_from_another_device_is_refused(make_runner, manifest_path):
    other = edited(
        manifest_path, lambda d: d["environment"].update(device="NVIDIA H200", backend="cuda")
    )
    report = make_runner(buckets=BUCKETS).prewarm(other, progress=False)
    assert report.refused == (
        "device: manifest is for NVIDIA H200 (cuda backend); this runner is on cpu (sim backend)"
    )


def test_runner_without_a_graph_backend_refuses_every_manifest(manifest_path):
    runner = gg.GraphRunner(mlp_step, buckets=BUCKETS, backend="sim")
    runner.backend = None  # what backend="auto" resolves to without CUDA
    report = runner.prewarm(manifest_path, progress=False)
    assert report.refused is not None and "no graph backend" in report.refused


def test_manifest_of_another_model_is_refused(captured, make_runner, tmp_path):
    ours = {"name": "smollm2", "config_hash": "abc"}
    manifest = export_manifest(captured, tmp_path / "m.json", model=ours)
    runner = make_runner(buckets=BUCKETS)
    report = prewarm(runner, manifest, progress=False, model={**ours, "config_hash": "def"})
    assert report.refused == (
        "model: manifest is for model smollm2 (config abc); this is model smollm2 (config def)"
    )
    assert prewarm(runner, manifest, progress=False, model=ours).refused is None


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "cannot read"),
        ('{"format": "other"}', "not a graphguard manifest"),
        ('{"format": "graphguard-manifest", "version": 1, "environment": {}}', "list of graphs"),
    ],
)
def test_unreadable_manifest_is_refused_without_raising(make_runner, tmp_path, content, why):
    path = tmp_path / "bad.json"
    path.write_text(content)
    report = make_runner().prewarm(path, progress=False)
    assert report.refused is not None and report.refused.startswith("unreadable")
    assert why in report.refused


def test_manifest_of_another_version_is_refused_as_such(make_runner, tmp_path):
    path = tmp_path / "future.json"
    path.write_text('{"format": "graphguard-manifest", "version": 99}')
    runner = make_runner()
    report = runner.prewarm(path, progress=False)
    assert report.refused is not None and report.refused.startswith("version")
    assert "version 99" in report.refused
    assert runner.metrics.prewarm_refusals.labels("version")._value.get() == 1


def test_missing_manifest_is_refused_without_raising(make_runner, tmp_path):
    report = make_runner().prewarm(tmp_path / "nowhere.json", progress=False)
    assert report.refused is not None and "No such file" in report.refused


def test_refusal_is_counted_and_logged(make_runner, tmp_path, caplog):
    runner = make_runner()
    with caplog.at_level(logging.WARNING, logger="graphguard"):
        runner.prewarm(tmp_path / "nowhere.json", progress=False)
    refusals = runner.metrics.prewarm_refusals.labels("unreadable")
    assert refusals._value.get() == 1
    assert "prewarm refused" in caplog.text and "captured lazily" in caplog.text


# -- prewarm -------------------------------------------------------------------------------
def test_prewarm_captures_exactly_the_manifest_keys(captured, make_runner, manifest_path):
    runner = make_runner(buckets=BUCKETS, admission=EAGER_FIRST)
    report = runner.prewarm(manifest_path, progress=False)
    assert set(runner.admitted_keys()) == set(captured.admitted_keys())
    assert report.refused is None and report.skipped == {} and len(report.captured) == 3


def test_prewarmed_graphs_replay_equal_to_eager_without_a_capture(make_runner, manifest_path):
    runner = make_runner(buckets=BUCKETS, admission=gg.AdmissionConfig(min_hits=5))
    runner.prewarm(manifest_path, progress=False)
    num_captures = runner.backend.num_captures
    for rows in (1, 3, 8):
        x, pos = inputs(rows, seed=rows)
        got = runner(x, pos)
        assert all(torch.equal(a, b) for a, b in zip(got, mlp_step(x, pos), strict=True))
    assert runner.backend.num_captures == num_captures
    assert runner.stats()["replays"] == 3  # served; prewarm's verified replays answered no call


def test_prewarm_goes_largest_first_and_stops_at_the_budget(make_runner, manifest_path):
    entry_bytes = {g["rows"]: g["resident_bytes"] for g in read_manifest(manifest_path)["graphs"]}
    budget = entry_bytes[8] + entry_bytes[4]
    runner = make_runner(buckets=BUCKETS, max_bytes=budget)
    report = runner.prewarm(manifest_path, progress=False)
    assert [k.rows for k in runner.admitted_keys()] == [8, 4]
    assert list(report.skipped.values()) == ["over_budget"]


def test_prewarm_fills_example_inputs_with_the_pad_value_of_each_position(captured, manifest_path):
    examples, skipped = plan_examples(captured, read_manifest(manifest_path)["graphs"])
    assert skipped == {}
    for x, pos in examples:
        assert bool((x == 0.5).all()) and bool((pos == -1.0).all())


def test_manifest_key_that_maps_to_another_bucket_here_is_skipped(make_runner, manifest_path):
    runner = make_runner(buckets=gg.Buckets(batch=(8, 16)))
    report = runner.prewarm(manifest_path, progress=False)
    assert [k.rows for k in runner.admitted_keys()] == [8]
    assert sorted(r.split(":")[0] for r in report.skipped.values()) == ["key_mismatch"] * 2


def test_prewarm_reports_seconds_and_keys_in_metrics_and_a_log_line(
    make_runner, manifest_path, caplog
):
    runner = make_runner(buckets=gg.Buckets(batch=(8, 16)))
    with caplog.at_level(logging.INFO, logger="graphguard"):
        report = runner.prewarm(manifest_path, progress=False)
    metrics = runner.metrics
    assert metrics.prewarm_seconds._value.get() == pytest.approx(report.seconds)
    assert report.seconds > 0
    assert metrics.prewarm_keys.labels("prewarmed")._value.get() == 1
    assert metrics.prewarm_keys.labels("skipped")._value.get() == 2
    assert "graphguard prewarm runner=graph" in caplog.text
    assert "prewarmed=1 skipped=2" in caplog.text


# -- inspect -------------------------------------------------------------------------------
def test_inspect_prints_a_row_per_graph_with_bytes_and_parity(manifest_path, capsys):
    assert graphguard_main(["inspect", str(manifest_path)]) == 0
    out = capsys.readouterr().out
    assert "runner mlp: 3 graphs" in out and "(sim backend)" in out
    rows = [line for line in out.splitlines() if "admitted" in line]
    assert len(rows) == 3 and all("2.0 MiB" in r and "exact" in r for r in rows)
    assert "float32[8x8]@cpu" in rows[0]
    assert "graph 0: unavailable: the sim backend has no CUDA graph nodes" in out


def test_inspect_of_a_manifest_without_graphs_prints_the_header(make_runner, tmp_path, capsys):
    make_runner().export(tmp_path / "empty.json")
    assert graphguard_main(["inspect", str(tmp_path / "empty.json")]) == 0
    assert "0 graphs" in capsys.readouterr().out


def test_inspect_json_prints_the_manifest(manifest_path, capsys):
    assert graphguard_main(["inspect", str(manifest_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(manifest_path.read_text())


def test_inspect_of_an_unreadable_manifest_exits_1(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("[]")
    assert graphguard_main(["inspect", str(tmp_path / "bad.json")]) == 1
    assert "not a graphguard manifest" in capsys.readouterr().err


def test_inspect_lists_the_most_launched_kernels_of_a_graph(manifest_path):
    inventory = NodeInventory(
        num_nodes=5,
        node_types={"kernel": 4, "memcpy": 1},
        kernels={"nvjet_tst_64x8_64x16_gemm": 3, "cunn_SoftMaxForward": 1},
    )
    data = edited(manifest_path, lambda d: d["graphs"][0].update(inventory=inventory.to_json()))
    text = render(data, max_kernels=1)
    assert "graph 0: 5 nodes (4 kernel, 1 memcpy)" in text
    assert "3 x nvjet_tst_64x8_64x16_gemm" in text and "1 more kernels" in text


# -- the engine and `graphguard serve --graph-manifest` ------------------------------------
def tiny_loaded(name: str = "tiny", num_layers: int = 2):
    from bench.decode import NumberTokenizer
    from graphguard.engine.models import build_model
    from graphguard.engine.models.loader import LoadedModel
    from tests.tiny import tiny_config

    config = tiny_config(
        vocab_size=96, num_layers=num_layers, rms_norm_eps=1e-5, max_position_embeddings=64
    )
    model = build_model(config, dtype=torch.float32, device="cpu", seed=0)
    return LoadedModel(name, model, config, NumberTokenizer(config))  # type: ignore[arg-type]


def tiny_engine(loaded, **overrides):
    from graphguard.engine.config import engine_config
    from graphguard.engine.engine import LLMEngine

    settings = dict(max_num_seqs=4, max_model_len=32, max_num_batched_tokens=64, block_size=4)
    settings.update(num_kv_blocks=40, batch_buckets=(1, 2, 4), graph_backend="sim")
    settings.update(price_captures=False)  # no graph at a lazy start but what a manifest gives
    return LLMEngine(engine_config(**{**settings, **overrides}), loaded)


def decode_a_while(engine) -> None:
    from graphguard.engine.tokens.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(([5, 6, 7], [8, 9], [10, 11, 12, 13])):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def decode_manifest(tmp_path) -> tuple[Path, set]:
    engine = tiny_engine(tiny_loaded())
    try:
        decode_a_while(engine)
        path = tmp_path / "decode.json"
        manifest = engine.graphs.export(path)
        assert manifest["model"]["name"] == "tiny" and manifest["graphs"]
        return path, set(engine.graphs.decode.admitted_keys())
    finally:
        engine.shutdown()


def test_engine_with_a_graph_manifest_starts_with_the_same_decode_keys(decode_manifest):
    path, keys = decode_manifest
    engine = tiny_engine(tiny_loaded(), graph_manifest=str(path))
    try:
        assert set(engine.graphs.decode.admitted_keys()) == keys
        assert engine.graphs.stats()["captures"] == len(keys)
    finally:
        engine.shutdown()


def test_a_manifest_prices_the_decode_captures_of_a_lazy_start(decode_manifest):
    path, keys = decode_manifest
    assert {key.rows for key in keys} != {1}  # a decode of one row would be the price's probe
    engine = tiny_engine(tiny_loaded(), graph_manifest=str(path), price_captures=True)
    try:
        # the manifest's captures priced the decode graphs: no probe besides them; the prefill
        # graphs, which the manifest does not hold, are priced by one 16-token group
        assert set(engine.graphs.decode.admitted_keys()) == keys
        assert engine.graphs.stats()["prefill"]["captures"] == 1
    finally:
        engine.shutdown()


def test_engine_refuses_a_manifest_of_another_model_and_starts_lazily(decode_manifest):
    path, _ = decode_manifest
    engine = tiny_engine(tiny_loaded(num_layers=3), graph_manifest=str(path))
    try:
        assert engine.graphs.decode.admitted_keys() == []
        refusals = engine.graphs.metrics.prewarm_refusals.labels("model")
        assert refusals._value.get() == 1
        decode_a_while(engine)
        assert engine.graphs.stats()["captures"] > 0
    finally:
        engine.shutdown()


def test_serve_flag_graph_manifest_reaches_the_engine_config():
    from graphguard.server.cli import build_parser, config_from_args

    args = build_parser().parse_args(["--graph-manifest", "/srv/decode.json"])
    assert config_from_args(args).engine.graphs.manifest == "/srv/decode.json"
    assert config_from_args(build_parser().parse_args([])).engine.graphs.manifest is None


def test_a_manifest_key_that_cannot_be_built_is_skipped_not_raised(make_runner, manifest_path):
    def negative_and_huge(data):
        data["graphs"][0]["key"]["args"][0]["tensor"]["shape"][0] = -3
        data["graphs"][1]["key"]["args"][0]["tensor"]["shape"][1] = 1 << 40

    runner = make_runner(buckets=BUCKETS)
    report = runner.prewarm(edited(manifest_path, negative_and_huge), progress=False)
    assert any("negative dimension" in why for why in report.skipped.values())
    assert any("exceed the byte budget" in why for why in report.skipped.values())
