"""Put serve_load runs side by side: one row per mode, the targets of "no request waits for a
capture" checked against the eager run, and a TTFT-over-time plot (PNG, when matplotlib is
installed).

    python bench/serve_compare.py bench-results/serve_load_gpu_*.json --png ttft_over_time.png

A run's mode is the `mode` its report records (bench/serve_load.py --mode, else from its flags).
Several reports of one mode (rounds: `ROUNDS=3 tools/gpu-serve-check`) are shown one row each,
then pooled: TTFT and TPOT percentiles over every request of every round, requests/s over their
summed wall time. The targets are checked on the pooled runs, as one round's p99 moves with
the host (eager's p99 ranged from 112 to 499 ms over five rounds of the same load on an H200).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_load import RequestResult, summarize  # noqa: E402

COLUMNS = (
    ("requests_per_s", "req/s"),
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p99_ms", "TTFT p99"),
    ("tpot_p50_ms", "TPOT p50"),
    ("decode_captures", "dec capt"),
    ("prefill_captures", "pre capt"),
    ("decode_hit_rate", "dec hit"),
    ("decode_covered", "dec cover"),
    ("prefill_hit_rate", "pre hit"),
    ("decode_capture_unit_max_ms", "dec unit ms"),
    ("prefill_capture_unit_max_ms", "pre unit ms"),
    ("prefill_rows_captures", "rows capt"),
    ("prefill_rows_hit_rate", "rows hit"),
    ("prefill_rows_covered", "rows cover"),
    ("prefill_rows_capture_unit_max_ms", "rows unit ms"),
)
RUNNERS = ("decode", "prefill", "prefill_rows")  # the prefill's segmented groups, then rows


def load(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Reports by mode, modes and rounds in the order given."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        runs.setdefault(report.get("mode", path.stem), []).append(report)
    return runs


def pool(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for several rounds of a mode: the latency percentiles and requests/s of all
    their requests (bench/serve_load.py `summarize`), captures and fallbacks summed, hit rates
    weighted by calls, the longest capture unit of any round."""
    if len(reports) == 1:
        return reports[0]
    requests = [r for report in reports for r in report["requests"]]
    wall_s = sum(report["summary"]["wall_s"] for report in reports)
    summary: dict[str, Any] = summarize([RequestResult(**r) for r in requests], wall_s)
    for runner in RUNNERS:
        parts = [rep["summary"] for rep in reports if f"{runner}_calls" in rep["summary"]]
        if not parts:
            continue
        calls = sum(part[f"{runner}_calls"] for part in parts)
        replays = sum(part[f"{runner}_hit_rate"] * part[f"{runner}_calls"] for part in parts)
        fallbacks: dict[str, int] = {}
        for part in parts:
            for reason, count in part[f"{runner}_fallbacks"].items():
                fallbacks[reason] = fallbacks.get(reason, 0) + count
        summary |= {
            f"{runner}_calls": calls,
            f"{runner}_captures": sum(part[f"{runner}_captures"] for part in parts),
            f"{runner}_covered": sum(part.get(f"{runner}_covered", 0) for part in parts),
            f"{runner}_hit_rate": round(replays / calls, 4) if calls else 0.0,
            f"{runner}_fallbacks": fallbacks,
            f"{runner}_capture_unit_max_ms": max(
                part.get(f"{runner}_capture_unit_max_ms", 0.0) for part in parts
            ),
        }
    return {**reports[0], "summary": summary, "requests": requests, "rounds": len(reports)}


def table(runs: dict[str, dict[str, Any]]) -> str:
    head = ["mode", *(label for _, label in COLUMNS), "eager graph calls by reason"]
    rows = [head]
    for mode, report in runs.items():
        summary = report["summary"]
        cells = [mode, *(_cell(summary.get(key)) for key, _ in COLUMNS)]
        reasons: dict[str, int] = {}
        for runner in RUNNERS:
            for reason, count in summary.get(f"{runner}_fallbacks", {}).items():
                reasons[reason] = reasons.get(reason, 0) + count
        cells.append(", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "-")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def targets(runs: dict[str, dict[str, Any]]) -> list[tuple[str, bool]]:
    """The issue's targets, each checked where its runs are present."""
    if "eager" not in runs:
        return []
    eager = runs["eager"]["summary"]
    checks: list[tuple[str, bool]] = []
    if "graphs" in runs:
        lazy = runs["graphs"]["summary"]
        checks += [
            ("lazy TTFT p50 <= eager", lazy["ttft_p50_ms"] <= eager["ttft_p50_ms"]),
            ("lazy TTFT p99 <= 1.1x eager", lazy["ttft_p99_ms"] <= 1.1 * eager["ttft_p99_ms"]),
            ("lazy req/s >= 3x eager", lazy["requests_per_s"] >= 3 * eager["requests_per_s"]),
        ]
    if "graphs-warm" in runs:
        warm = runs["graphs-warm"]
        summary, background = warm["summary"], not warm["config"].get("no_background_capture")
        captures = sum(summary.get(f"{runner}_captures") or 0 for runner in RUNNERS)
        checks += [
            ("warm: no capture during the load (every key captured at start)", captures == 0),
            ("warm: a capture would run between steps, not in them", bool(background)),
            ("warm TTFT p99 <= eager", summary["ttft_p99_ms"] <= eager["ttft_p99_ms"]),
        ]
    return checks


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def plot(runs: dict[str, dict[str, Any]], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, report in runs.items():
        points = sorted((r["sent_s"], r["ttft_s"] * 1e3) for r in report["requests"])
        ax.plot([p[0] for p in points], [p[1] for p in points], ".-", label=mode, alpha=0.8)
    ax.set_xlabel("request sent (s after the load started)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("Time to first token over the load, by mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="serve_load JSON reports")
    parser.add_argument("--png", type=Path, help="write the TTFT-over-time plot here")
    args = parser.parse_args(argv)
    rounds = load(args.reports)
    if any(len(reports) > 1 for reports in rounds.values()):
        print("each round:")
        each = {f"{mode} #{i}": r for mode, rs in rounds.items() for i, r in enumerate(rs, 1)}
        print(table(each))
        print(f"pooled ({', '.join(f'{mode} x{len(rs)}' for mode, rs in rounds.items())}):")
    runs = {mode: pool(reports) for mode, reports in rounds.items()}
    print(table(runs))
    for name, ok in targets(runs):
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.png is not None:
        print(f"wrote {args.png}" if plot(runs, args.png) else "no plot: matplotlib is missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
