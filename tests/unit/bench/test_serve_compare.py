"""bench/serve_compare.py pools several rounds of a mode into one: latency percentiles over
every request of every round, requests/s over their summed wall time, capture counts summed
and hit rates weighted by calls; the targets are checked on the pooled runs."""

from __future__ import annotations

import json
from pathlib import Path

from bench.serve_compare import load, pool, targets


def report(mode: str, ttfts_ms: list[float], wall_s: float, calls: int, hits: float) -> dict:
    requests = [
        {"sent_s": i * 0.01, "ttft_s": t / 1e3, "tpot_s": 0.002, "latency_s": 0.2,
         "num_output_tokens": 64}
        for i, t in enumerate(ttfts_ms)
    ]  # fmt: skip
    summary = {
        "wall_s": wall_s,
        "requests_per_s": len(requests) / wall_s,
        "ttft_p50_ms": sorted(ttfts_ms)[len(ttfts_ms) // 2],
        "ttft_p99_ms": max(ttfts_ms),
        "decode_calls": calls,
        "decode_captures": 1,
        "decode_hit_rate": hits,
        "decode_covered": calls // 4,
        "decode_fallbacks": {"admission_deferred": 2},
        "decode_capture_unit_max_ms": 30.0 + calls,
    }
    return {"mode": mode, "config": {}, "summary": summary, "requests": requests}


def test_rounds_of_a_mode_pool_their_requests(tmp_path: Path) -> None:
    paths = []
    rounds = [report("graphs", [10.0] * 99 + [500.0], 2.0, 100, 0.5),
              report("graphs", [20.0] * 100, 3.0, 300, 0.9)]  # fmt: skip
    for i, one in enumerate([*rounds, report("eager", [30.0] * 100, 10.0, 0, 0.0)]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(one))
    runs = load(paths)
    assert [len(reports) for reports in runs.values()] == [2, 1]
    pooled = pool(runs["graphs"])["summary"]
    # one slow request in 200 is no longer the p99: the pooled p99 is the 198th of 200
    assert pooled["ttft_p99_ms"] == 20.0 and pooled["ttft_p50_ms"] == 20.0
    assert pooled["requests_per_s"] == 200 / 5.0
    assert pooled["decode_captures"] == 2 and pooled["decode_calls"] == 400
    assert pooled["decode_covered"] == 25 + 75
    assert pooled["decode_hit_rate"] == (0.5 * 100 + 0.9 * 300) / 400
    assert pooled["decode_fallbacks"] == {"admission_deferred": 4}
    assert pooled["decode_capture_unit_max_ms"] == 330.0
    assert pool(runs["eager"]) is runs["eager"][0]  # one round: as it is
    checks = dict(targets({mode: pool(reports) for mode, reports in runs.items()}))
    assert checks["lazy TTFT p99 <= 1.1x eager"]  # pooled 20 ms against 30; round 1 alone: 500
    assert not dict(targets({"graphs": rounds[0], "eager": runs["eager"][0]}))[
        "lazy TTFT p99 <= 1.1x eager"
    ]
