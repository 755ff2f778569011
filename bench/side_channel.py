"""Can one client tell, from its time to the first token, that another client already sent a
document? The prefix cache's timing side channel, measured against a real `graphguard serve`.

A victim sends a long document; the prober then sends the same document and, as a baseline, a
document of the same length nobody sent. The ratio of the two times to first token is the
signal: far above 1 where the cache shares the victim's blocks with the prober, about 1 where
it keeps them apart. Measured four ways, each in a fresh document per round:

- `shared`: one key, no salts (what any cache without tenants leaks);
- `salts`: one key, the victim and the prober with different `cache_salt`s;
- `keys`: two API keys, the server's default `--prefix-cache-isolation key`;
- `keys_shared`: two API keys under `--prefix-cache-isolation shared` (the leak, on purpose).

    .venv/bin/python -m bench.side_channel                 # the embedded model on this CPU
    .venv/bin/python -m bench.side_channel --rounds 5 --out bench/results/side_channel.json

Prints one line per way and writes the JSON with every round's times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.local_serve import local_serve

KEYS = ("sk-victim-0123", "sk-prober-4567")
MODEL = "SmolLM2-135M-Instruct"
WAYS = {  # way -> (server flags, victim's key and salt, prober's key and salt)
    "shared": ([], (KEYS[0], None), (KEYS[0], None)),
    "salts": ([], (KEYS[0], "victim"), (KEYS[0], "prober")),
    "keys": ([], (KEYS[0], None), (KEYS[1], None)),
    "keys_shared": (["--prefix-cache-isolation", "shared"], (KEYS[0], None), (KEYS[1], None)),
}


def time_to_first_token(url: str, key: str, salt: str | None, prompt: str) -> float:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def document(way: str, round_index: int, kind: str, num_words: int) -> str:
    """A document nobody sent before: its first words differ from every other's."""
    head = f"Document {way}-{round_index}-{kind}: the minutes of a board meeting."
    return head + " The board met and decided." * (num_words // 5)


def measure(way: str, flags: list[str], rounds: int, num_words: int) -> dict[str, Any]:
    _, victim, prober = WAYS[way]
    runs = []
    with local_serve(["--api-key", ",".join(KEYS), *flags]) as server:
        time_to_first_token(server.url, *victim, "warm-up")  # the first request's own costs
        for index in range(rounds):
            sent = document(way, index, "sent", num_words)
            time_to_first_token(server.url, *victim, sent)
            probed = time_to_first_token(server.url, *prober, sent)
            fresh = time_to_first_token(server.url, *prober, document(way, index, "new", num_words))
            runs.append({"probed_s": probed, "fresh_s": fresh, "ratio": fresh / probed})
    ratio = statistics.median(run["ratio"] for run in runs)
    return {"way": way, "flags": flags, "median_ratio": ratio, "rounds": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", type=int, default=1100, help="about 1,500 tokens")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    for way in args.ways.split(","):
        result = measure(way, WAYS[way][0], args.rounds, args.words)
        results.append(result)
        print(f"{way:12s} fresh / probed time to first token: {result['median_ratio']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
