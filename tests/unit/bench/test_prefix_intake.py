"""bench/prefix_intake.py at a size the CPU runs in seconds: both settings measured, each
wave's requests admitted over the cached document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import prefix_intake


def test_a_tiny_run_measures_both_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--clients", "3", "--prefix", "64", "--question", "5", "--waves", "1"]
    rows = json.loads(prefix_intake.main(argv).read_text())["rows"]
    assert set(rows) == {"memory on", "memory off"}
    for row in rows.values():
        assert row["add_ms"] > 0 and row["schedule_ms"] > 0
        assert row["total_ms"] == pytest.approx(row["add_ms"] + row["schedule_ms"])
