"""The host's work to admit a wave of requests over one cached document (CPU): each request's
`add_request` and the scheduler's pass that admits them all, with the prefix cache's memory of
recent prompts on and off side by side (`PrefixCache.recent`, docs/serving.md "Prefix
caching"). Without it every request hashes all of its blocks.

The model is the long-context bench's Qwen3-0.6B shape at its tiny size (the model's work is
not measured); waves alternate between the two settings on one engine, each request a new
question after the same document.

    python bench/prefix_intake.py [--clients 16] [--prefix 4096] [--question 32] [--waves 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.long_context import load  # noqa: E402
from bench.shared_prefix import random_prompts  # noqa: E402
from bench.timing import write_json  # noqa: E402
from graphguard.engine.config import EngineConfig  # noqa: E402
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.scheduling.prefix_cache import RecentPrompts  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402


def wave(
    llm: LLM, document: list[int], questions: list[list[int]], tag: str
) -> tuple[float, float]:
    """(ms of the wave's add_request calls, ms of the scheduler pass that admits them); the
    wave then runs to its end (one token each)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timed: list[float] = []
    schedule = engine.scheduler.schedule

    def timed_schedule():  # the first pass after the adds admits the wave
        began = time.perf_counter()
        batch = schedule()
        timed.append(1e3 * (time.perf_counter() - began))
        return batch

    began = time.perf_counter()
    for index, question in enumerate(questions):
        engine.add_request(f"{tag}-{index}", document + question, params)
    add_ms = 1e3 * (time.perf_counter() - began)
    engine.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return add_ms, timed[0]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--waves", type=int, default=8, help="waves of each setting")
    args = parser.parse_args(argv)
    loaded = load("qwen3-0.6b", tiny=True)
    block_size = EngineConfig().block_size
    length = args.prefix + args.question + 1
    blocks = args.clients * (-(-length // block_size) + 1) + 2 * (args.prefix // block_size)
    llm = LLM(loaded, max_model_len=length + block_size, max_num_seqs=args.clients,
              num_kv_blocks=blocks + 8, prefix_caching=True, enforce_eager=True)  # fmt: skip
    vocab = loaded.config.vocab_size
    document = random_prompts(1, args.prefix, vocab, seed=1)[0]
    cache = llm.engine.scheduler.prefix_cache
    assert cache is not None
    remembering = cache.recent
    times: dict[str, list[tuple[float, float]]] = {"memory on": [], "memory off": []}
    try:
        wave(llm, document, random_prompts(1, args.question, vocab, seed=0), "cached")
        for index in range(2 * args.waves + 2):  # the first two are warm-ups
            setting = "memory on" if index % 2 == 0 else "memory off"
            cache.recent = remembering if setting == "memory on" else RecentPrompts(capacity=0)
            questions = random_prompts(args.clients, args.question, vocab, seed=100 + index)
            measured = wave(llm, document, questions, f"w{index}")
            if index >= 2:
                times[setting].append(measured)
    finally:
        llm.shutdown()
    rows = {}
    for setting, waves in times.items():
        add = statistics.median(m[0] for m in waves)
        schedule = statistics.median(m[1] for m in waves)
        rows[setting] = dict(add_ms=add, schedule_ms=schedule, total_ms=add + schedule)
        print(f"{setting:>10}: {args.clients} requests over a {args.prefix}-token document: "
              f"add {add:.2f} ms, admitting schedule {schedule:.2f} ms, total {add + schedule:.2f}"
              " (median of waves)")  # fmt: skip
    path = write_json("prefix_intake.json", dict(args=vars(args), rows=rows))
    print(f"-> {path}")
    return path


if __name__ == "__main__":
    main()
