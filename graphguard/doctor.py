"""`graphguard doctor`: what this machine can do with graphs, checked by doing it."""

from __future__ import annotations

import argparse
import os

import torch

import graphguard as gg
from graphguard.core.switch import KILL_SWITCH_ENV, kill_switch_on
from graphguard.kernels.isa import cpu_features


def _check(backend: str, device: str) -> str:
    w = torch.randn(64, 64, device=device)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sum(-1)

    runner = gg.GraphRunner(
        step,
        backend=backend,
        buckets=gg.Buckets(batch=[1, 4]),
        admission=gg.AdmissionConfig(min_hits=1),
    )
    try:
        for rows in (4, 4, 1, 3):
            x = torch.randn(rows, 64, device=device)
            # A padded batch (3 rows on the 4-row graph) may round differently from an eager
            # 3-row matmul; a full bucket must match bitwise.
            same = torch.equal if rows in (1, 4) else torch.allclose
            if not same(runner(x), step(x)):
                return f"FAIL: replay of {rows} rows differs from eager"
        stats = runner.stats()
    finally:
        runner.close()
    if stats["fallbacks"]:
        return f"fallbacks {stats['fallbacks']}"
    ms = stats["admission"]["capture_seconds"] * 1e3
    return f"ok: {stats['captures']} captures, {stats['replays']} replays, capture {ms:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphguard doctor", description=__doc__)
    parser.parse_args(argv)
    rows = [
        ("graphguard", gg.__version__),
        ("torch", torch.__version__),
        ("cuda available", str(torch.cuda.is_available())),
        (KILL_SWITCH_ENV, f"{os.environ.get(KILL_SWITCH_ENV, '')!r} (on: {kill_switch_on()})"),
        ("cpu kernels use", ", ".join(cpu_features())),
        ("sim backend (cpu)", _check("sim", "cpu")),
    ]
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        rows.append(("device", f"{name} (sm_{major}{minor})"))
        rows.append(("cuda backend", _check("cuda", "cuda")))
    else:
        rows.append(("cuda backend", "skipped: no CUDA device (graphs fall back with no_cuda)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 1 if any(v.startswith("FAIL") for _, v in rows) else 0
