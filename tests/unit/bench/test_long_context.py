"""bench/long_context.py at a size the CPU runs in seconds: every requested row is in the JSON,
measured (with its floors) or skipped with a reason, and so is each shared-prefix run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import long_context

TINY_RUN = [
    "--tiny", "--prompts", "32,64", "--batches", "1,2", "--decode-tokens", "3",
    "--clients", "3", "--rounds", "2", "--prefix", "32", "--question", "4",
    "--answer-tokens", "2", "--skip", "llama-3.1-8b:64:2",
]  # fmt: skip


def test_a_tiny_run_writes_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    path = long_context.main(TINY_RUN)
    result = json.loads(path.read_text())
    rows = {(r["shape"], r["prompt_tokens"], r["batch"]): r for r in result["rows"]}
    expected = {(s, n, b) for s in long_context.SHAPES for n in (32, 64) for b in (1, 2)}
    assert set(rows) == expected and len(result["rows"]) == len(expected)
    assert rows[("llama-3.1-8b", 64, 2)]["skipped"] == "--skip"
    measured = [r for key, r in rows.items() if key != ("llama-3.1-8b", 64, 2)]
    for row in measured:
        assert "skipped" not in row, row
        for key in ("prefill", "decode"):
            assert row[f"{key}_tok_s"] > 0 and row[f"{key}_floor_tok_s"] > 0
            assert row[f"{key}_fraction"] == pytest.approx(
                row[f"{key}_tok_s"] / row[f"{key}_floor_tok_s"]
            )
        assert row["decode_streams"] == row["batch"]  # every stream decoded in the timed steps
    shared = {run["prefix_caching"]: run for run in result["shared_prefix"]}
    assert set(shared) == {True, False}
    for run in shared.values():
        assert run["requests"] == 3 * 2 and run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0
    assert shared[True]["prefix_cache"]["hit_rate"] > 0  # the document came from the cache


def test_a_row_whose_kv_pool_does_not_fit_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    run = ["--tiny", "--shapes", "qwen3-0.6b", "--prompts", "4096", "--batches", "16",
           "--no-shared", "--cpu-kv-gib", "0.001"]  # fmt: skip
    result = json.loads(long_context.main(run).read_text())
    (row,) = result["rows"]
    assert row["skipped"].startswith("KV pool") and "free" in row["skipped"]
