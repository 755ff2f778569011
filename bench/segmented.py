"""Segmented prefill graphs vs eager: prefill, image requests, and eight-question churn.

SmolLM2-135M shape with random weights (bf16) and the random-weight vision encoder; attention
runs eagerly between graphed segments (graphguard.engine.models.forward, prefill_graphs). Workloads:

- prefill: one text prompt of T tokens, per-call ms, eager vs replayed segment groups;
- image: vision encoding + prefill of an image-plus-text prompt, eager vs segmented;
- churn: eight distinct questions (eight token counts, one image each) cycling under a budget
  that holds three groups: eager vs naive capture-on-miss vs graphguard's admission policy,
  p50/p99 per request. Target: graphguard p50 <= 1.05x eager (the policy must not lose).

    python bench/segmented.py [--layers 30] [--scale 1.0]
    python bench/segmented.py --smoke      # CPU + SimBackend, tiny model: checks it runs
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

# Pinned cuBLAS workspaces: the same kernels on every stream (docs/runtime.md).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import graphguard as gg  # noqa: E402
from bench.timing import latencies_ms, per_call_ms, percentile, write_json  # noqa: E402
from graphguard.engine.config import PRESETS  # noqa: E402
from graphguard.engine.models import build_model  # noqa: E402
from graphguard.engine.models.attention import AttentionMetadata  # noqa: E402
from graphguard.engine.models.forward import (  # noqa: E402
    ImageSplice,
    PrefillContext,
    eager_prefill,
    prefill_inputs,
    prefill_stages,
)
from graphguard.engine.models.vision import VisionConfig, build_vision_encoder  # noqa: E402
from graphguard.engine.scheduling.kv import PagedKVStorage  # noqa: E402
from graphguard.segmented import SegmentedRunner  # noqa: E402

BLOCK = 16
IMAGE_TOKEN = 16
NAIVE = gg.AdmissionConfig(
    min_hits=1, frequency_aware=False, max_capture_fraction=1.0, max_recaptures=1 << 30
)
WARM = gg.AdmissionConfig(min_hits=1, frequency_aware=False, max_capture_fraction=1.0)


class Bench:
    """Model, KV, vision encoder and request builders on one device."""

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype) -> None:
        config = replace(PRESETS["smollm2-135m"], num_layers=num_layers)
        self.device, self.config = device, config
        self.model = build_model(config, dtype=dtype, device=device, seed=0)
        self.kv = PagedKVStorage(
            num_layers=num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_blocks=2 + 1024 // BLOCK,
            block_size=BLOCK,
            dtype=dtype,
            device=device,
        )
        self.vision = build_vision_encoder(
            VisionConfig(),
            text_hidden_size=config.hidden_size,
            image_token_id=IMAGE_TOKEN,
            dtype=dtype,
            device=device,
        )
        self.backend: Any = "sim" if device.type == "cpu" else "cuda"

    def runner(self, max_bytes: int, admission: gg.AdmissionConfig, verify: str = "exact"):
        return SegmentedRunner(
            prefill_stages(self.model, self.kv),
            max_bytes=max_bytes,
            backend=self.backend,
            admission=admission,
            verify=verify,
            capture=gg.CaptureConfig(copy_outputs=False, retain=(self.model, self.kv)),
        )

    def request(self, num_tokens: int, seed: int, with_image: bool) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(17, self.config.vocab_size, (num_tokens,), generator=g)
        pixels = torch.rand(3, 64, 64, generator=g) * 2 - 1 if with_image else None
        return dict(
            ids=ids.to(self.device),
            positions=torch.arange(num_tokens, device=self.device),
            meta=self.metadata(num_tokens),
            pixels=pixels,
        )

    def metadata(self, num_tokens: int) -> AttentionMetadata:
        table = list(range(1, 1 + -(-num_tokens // BLOCK)))
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_tokens)]
        dev = self.device
        return AttentionMetadata(
            packed=True,
            slot_mapping=torch.tensor(slots, device=dev),
            block_tables=torch.tensor([table], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens_cpu=[num_tokens],
            query_lens_cpu=[num_tokens],
        )

    @torch.no_grad()
    def serve(self, req: dict[str, Any], runner: SegmentedRunner | None) -> torch.Tensor:
        """One request: encode its image (if any), splice it after 4 tokens, prefill."""
        splice = None
        if req["pixels"] is not None:
            embeds = self.vision.embed_images([req["pixels"]])
            rows = torch.arange(4, 4 + embeds.shape[0], device=self.device)
            splice = ImageSplice(rows, embeds)
        ids, positions, meta = req["ids"], req["positions"], req["meta"]
        if runner is None:
            return eager_prefill(self.model, self.kv, ids, positions, meta, splice)
        inputs = prefill_inputs(self.model, ids, positions, splice, meta)
        return runner(inputs, PrefillContext(meta, self.kv))[0]


def latency_pair(bench: Bench, req: dict[str, Any], iters: int) -> dict[str, float]:
    runner = bench.runner(1 << 40, WARM)
    bench.serve(req, runner)  # capture and verify
    graphs = per_call_ms(lambda: bench.serve(req, runner), iters=iters)
    eager = per_call_ms(lambda: bench.serve(req, None), iters=iters)
    stats = runner.stats()
    runner.close()
    return dict(
        eager_ms=eager,
        segmented_ms=graphs,
        speedup=eager / graphs,
        group_bytes=stats["resident_bytes"],
        segments=stats["num_segments"],
        capture_ms=stats["admission"]["capture_seconds"] * 1e3,
    )


def churn(bench: Bench, num_calls: int) -> dict[str, Any]:
    lengths = [24 + 9 * i for i in range(8)]  # eight distinct questions
    num_image = bench.vision.num_tokens_per_image
    requests = [bench.request(lengths[i % 8] + num_image, i, True) for i in range(num_calls)]
    probe = bench.runner(1 << 40, WARM)
    bench.serve(bench.request(max(lengths) + num_image, 0, True), probe)
    budget = 3 * probe.stats()["resident_bytes"]
    probe.close()
    results: dict[str, Any] = dict(budget_bytes=budget, num_calls=num_calls)
    for mode in ("eager", "naive", "graphguard"):
        runner = None
        if mode != "eager":
            admission = NAIVE if mode == "naive" else gg.AdmissionConfig()
            runner = bench.runner(budget, admission, "off" if mode == "naive" else "exact")
        lat = latencies_ms([partial(bench.serve, r, runner) for r in requests])
        results[mode] = dict(p50=percentile(lat, 50), p99=percentile(lat, 99))
        if runner is not None:
            stats = runner.stats()
            keep = ("captures", "evictions", "hit_rate", "fallbacks")
            results[mode].update({k: stats[k] for k in keep})
            runner.close()
    results["graphguard_over_eager_p50"] = results["graphguard"]["p50"] / results["eager"]["p50"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the call counts")
    parser.add_argument("--smoke", action="store_true", help="CPU, SimBackend, 2 layers")
    args = parser.parse_args()
    if args.smoke:
        bench = Bench(2, torch.device("cpu"), torch.float32)
        iters, num_calls = 2, 16
    else:
        bench = Bench(args.layers, torch.device("cuda"), torch.bfloat16)
        iters, num_calls = max(3, int(20 * args.scale)), max(16, int(160 * args.scale))
    num_image = bench.vision.num_tokens_per_image
    results: dict[str, Any] = {"prefill": {}, "image": {}}
    for num_tokens in (32, 128, 512):
        req = bench.request(num_tokens, 0, False)
        results["prefill"][num_tokens] = latency_pair(bench, req, iters)
    for num_text in (32, 128):
        req = bench.request(num_text + num_image, 1, True)
        results["image"][num_text + num_image] = latency_pair(bench, req, iters)
    results["churn"] = churn(bench, num_calls)
    shape = dict(preset="smollm2-135m", layers=bench.config.num_layers, smoke=args.smoke)
    path = write_json("segmented.json", dict(shape=shape, results=results))
    report(results, path)


def report(results: dict[str, Any], path: Path) -> None:
    print(f"segmented prefill -> {path}")
    for kind in ("prefill", "image"):
        for tokens, r in results[kind].items():
            print(
                f"{kind:>7} T={tokens:<4} eager {r['eager_ms']:8.2f} ms  segmented "
                f"{r['segmented_ms']:8.2f} ms  x{r['speedup']:.2f}  "
                f"group {r['group_bytes'] / 2**20:.1f} MiB"
            )
    c = results["churn"]
    for mode in ("eager", "naive", "graphguard"):
        r = c[mode]
        extra = f" captures {r['captures']} evictions {r['evictions']}" if "captures" in r else ""
        print(f"  churn {mode:>10} p50 {r['p50']:8.2f} ms  p99 {r['p99']:8.2f} ms{extra}")
    print(f"  churn graphguard/eager p50 = {c['graphguard_over_eager_p50']:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
