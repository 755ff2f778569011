"""One stream, offline against served: the `LLM` API's decode rate and `graphguard serve`'s
streamed rate for the same prompt and token count, per kernel configuration, side by side in
one run, with their ratio (served / offline).

64 greedy tokens after "The capital of France is" (EOS ignored, as bench/cpu_decode.py). The
server is started for each configuration with `--max-num-seqs 4 --max-model-len 512`, like the
offline engine beside it in this process, and is read as a client reads it: a streamed
/v1/completions, tokens counted from the usage chunk, time from sending the request to the
last text. After one untimed run of each, offline and served runs alternate `--repeats` times
and the ratio is the median of each pair's: on a shared machine whose speed drifts, a pair
runs under the same load.

    python bench/serve_vs_offline.py [--configs float32,q4] [--repeats 5]
    python bench/serve_vs_offline.py --server-args=--no-engine-process   # the engine thread
    python bench/serve_vs_offline.py --server-pythonpath /other/checkout # serve another tree
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_serve import StreamReading, local_serve, stream_body  # noqa: E402
from bench.timing import write_json  # noqa: E402
from graphguard.engine.llm import LLM  # noqa: E402
from graphguard.engine.models.loader import load_model  # noqa: E402
from graphguard.engine.tokens.sampling import SamplingParams  # noqa: E402

PROMPT, NEW_TOKENS = "The capital of France is", 64
ENGINE_ARGS = ("--max-num-seqs", "4", "--max-model-len", "512")


def paired_rates(config: str, repeats: int, args: argparse.Namespace) -> list[tuple[float, float]]:
    """(offline, served) tokens per second of `config`, `repeats` pairs run back to back."""
    loaded = load_model(None, dtype="float32", device="cpu")
    llm = LLM(loaded, max_model_len=512, max_num_seqs=4, kernels="q4" if config == "q4" else "auto")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        with local_server(config, args) as client:
            llm.generate([PROMPT], params, use_tqdm=False)
            stream_once(client)
            pairs = []
            for _ in range(repeats):
                start = time.perf_counter()
                llm.generate([PROMPT], params, use_tqdm=False)
                offline = NEW_TOKENS / (time.perf_counter() - start)
                pairs.append((offline, NEW_TOKENS / stream_once(client)))
            return pairs
    finally:
        llm.engine.shutdown()


@contextmanager
def local_server(config: str, args: argparse.Namespace) -> Iterator[httpx.Client]:
    """A `graphguard serve` of `config` on a free loopback port, and a client of it."""
    flags = [*ENGINE_ARGS, "--device", "cpu", "--log-level", "warning"]
    flags += ["--kernels", "q4"] if config == "q4" else []
    flags += shlex.split(args.server_args)
    with local_serve(flags, pythonpath=args.server_pythonpath) as server:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            yield client


def stream_once(client: httpx.Client) -> float:
    """Seconds from sending one streamed request to its last text (NEW_TOKENS tokens)."""
    body = stream_body(client.get("/v1/models").json()["data"][0]["id"], PROMPT, NEW_TOKENS)
    start = time.perf_counter()
    reading = StreamReading()
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            reading.feed(line)
    assert reading.num_tokens == NEW_TOKENS, reading.num_tokens
    assert reading.last_text_s is not None, "the stream produced no text"
    return reading.last_text_s - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="float32,q4", help="comma list: float32, q4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server-args", default="", help="more `graphguard serve` flags")
    parser.add_argument("--server-pythonpath", help="serve the graphguard found here instead")
    parser.add_argument("--label", default="", help="a name for this run in the JSON file name")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for config in args.configs.split(","):
        pairs = paired_rates(config, args.repeats, args)
        offline = statistics.median(o for o, _ in pairs)
        served = statistics.median(s for _, s in pairs)
        ratio = statistics.median(s / o for o, s in pairs)
        rows.append(dict(config=config, offline_tok_s=offline, served_tok_s=served, ratio=ratio,
                         pairs=pairs))  # fmt: skip
        print(f"{config:8s} offline {offline:6.1f} tok/s  served {served:6.1f} tok/s  "
              f"ratio {ratio:.2f} (median of pairs)", flush=True)  # fmt: skip
    name = f"serve_vs_offline{'_' + args.label if args.label else ''}.json"
    path = write_json(name, {"rows": rows, "server_args": args.server_args, "argv": sys.argv})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
