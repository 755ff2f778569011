"""bench/load_bounds.py: which side bounded a load, and what a token cost each side."""

from __future__ import annotations

from types import SimpleNamespace

from bench.load_bounds import ClientRun, bound_report


def _run(num_tokens: list[int], cpu_s: float, wall_s: float) -> ClientRun:
    results = [SimpleNamespace(num_output_tokens=n) for n in num_tokens]
    return ClientRun(results, cpu_s=cpu_s, wall_s=wall_s)


def test_the_cost_of_a_token_is_each_sides_cpu_over_the_tokens_read() -> None:
    runs = [_run([100, 100], cpu_s=0.5, wall_s=2.0), _run([200], cpu_s=0.3, wall_s=2.0)]
    report = bound_report(
        runs,
        wall_s=2.0,
        cpu_before={"server": 10.0, "engine": 5.0},
        cpu_after={"server": 10.4, "engine": 6.9},
        counts_before={"steps": 0},
        counts_after={"steps": 200},
        tpot_p50_s=0.01,
    )

    assert report["client_cpu_us_per_token"] == 2000.0  # 0.8 s over 400 tokens
    assert report["server_cpu_us_per_token"] == 1000.0  # 0.4 s over 400 tokens
    assert report["engine_busy"] == 0.95 and report["bound"] == "engine"
    assert report["engine_step_interval_ms"] == 10.0


def test_a_client_busy_all_the_wall_is_the_bound() -> None:
    runs = [_run([10], cpu_s=1.9, wall_s=2.0)]
    report = bound_report(runs, 2.0, {"server": 0.0}, {"server": 0.2}, {}, {}, None)

    assert report["bound"] == "client"


def test_with_several_api_servers_the_busiest_is_the_servers_figure() -> None:
    runs = [_run([400], cpu_s=0.2, wall_s=2.0)]
    report = bound_report(
        runs,
        wall_s=2.0,
        cpu_before={"server": 0.0, "server_1": 0.0, "engine": 0.0},
        cpu_after={"server": 0.4, "server_1": 1.8, "engine": 1.0},
        counts_before={},
        counts_after={},
        tpot_p50_s=None,
    )

    assert report["server_busy_each"] == [0.2, 0.9]
    assert report["server_busy"] == 0.9 and report["bound"] == "server"
    assert report["server_cpu_us_per_token"] == 5500.0  # 2.2 s of both over 400 tokens
