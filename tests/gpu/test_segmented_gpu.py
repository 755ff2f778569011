"""Segmented prefill graphs on a real CUDA device (run through tools/gpu-check).

Random weights of the SmolLM2-135M shape (fewer layers), bf16: speed and parity do not depend
on the values. Image rows come from the random-weight vision encoder.
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace

import pytest
import torch

# Pinned cuBLAS workspaces: the same kernels on every stream, or exact parity cannot hold.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from graphguard.core.admission import AdmissionConfig  # noqa: E402
from graphguard.core.backends import CudaBackend  # noqa: E402
from graphguard.core.options import CaptureConfig  # noqa: E402
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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
EAGER_FIRST = AdmissionConfig(
    min_hits=1, frequency_aware=False, max_capture_fraction=1.0, max_recaptures=1 << 30
)
BLOCK = 16
IMAGE_TOKEN = 16


class Setup:
    """A random-weight decoder, its KV cache and a vision encoder on one device."""

    def __init__(self, device: torch.device, num_layers: int) -> None:
        config = replace(PRESETS["smollm2-135m"], num_layers=num_layers)
        self.device = device
        self.model = build_model(config, dtype=torch.bfloat16, device=device, seed=0)
        self.kv = PagedKVStorage(
            num_layers=num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_blocks=64,
            block_size=BLOCK,
            dtype=torch.bfloat16,
            device=device,
        )
        self.vision = build_vision_encoder(
            VisionConfig(),
            text_hidden_size=config.hidden_size,
            image_token_id=IMAGE_TOKEN,
            dtype=torch.bfloat16,
            device=device,
        )

    def request(self, num_text: int, text_seed: int, image_seed: int):
        """(inputs carry, context) of one image-plus-text prefill: image rows after 4 tokens."""
        num_image = self.vision.num_tokens_per_image
        num_tokens = num_text + num_image
        g = torch.Generator().manual_seed(text_seed)
        ids = torch.randint(17, self.model.config.vocab_size, (num_tokens,), generator=g)
        ids[4 : 4 + num_image] = IMAGE_TOKEN
        pixels = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(image_seed))
        rows = torch.arange(4, 4 + num_image, device=self.device)
        splice = ImageSplice(rows, self.vision.embed_images([pixels * 2 - 1]))
        ids, positions = ids.to(self.device), torch.arange(num_tokens, device=self.device)
        meta = self.metadata(num_tokens)
        return ids, positions, meta, splice

    def metadata(self, num_tokens: int) -> AttentionMetadata:
        table = list(range(1, 1 + -(-num_tokens // BLOCK)))
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_tokens)]

        def on_device(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return AttentionMetadata(
            packed=True,
            slot_mapping=on_device(slots, torch.int64),
            block_tables=on_device([table], torch.int32),
            seq_lens=on_device([num_tokens], torch.int32),
            query_start_loc=on_device([0, num_tokens], torch.int32),
            seq_lens_cpu=[num_tokens],
            query_lens_cpu=[num_tokens],
        )

    def runner(self, max_bytes: int) -> SegmentedRunner:
        return SegmentedRunner(
            prefill_stages(self.model, self.kv),
            max_bytes=max_bytes,
            backend=CudaBackend(self.device),
            admission=EAGER_FIRST,
            capture=CaptureConfig(retain=(self.model, self.kv)),
        )

    @torch.no_grad()
    def logits_both(self, runner: SegmentedRunner, request) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-vocabulary logits of every prompt row: segmented graphs, then eager."""
        ids, positions, meta, splice = request
        inputs = prefill_inputs(self.model, ids, positions, splice, meta)
        graphed = runner(inputs, PrefillContext(meta, self.kv))[0]
        eager = eager_prefill(self.model, self.kv, ids, positions, meta, splice)
        return self.model.compute_logits(graphed), self.model.compute_logits(eager)


def group_bytes(setup: Setup, num_text: int) -> int:
    runner = setup.runner(1 << 40)
    setup.logits_both(runner, setup.request(num_text, 0, 0))
    size = runner.stats()["resident_bytes"]
    runner.close()
    return size


def test_five_image_requests_give_bitwise_equal_logits_across_an_eviction(device):
    setup = Setup(device, num_layers=4)
    lengths = (20, 30, 40)  # three shape keys; the budget holds two groups
    runner = setup.runner(int(2.5 * max(group_bytes(setup, n) for n in lengths)))
    requests = [
        setup.request(20, text_seed=1, image_seed=1),  # captures key A
        setup.request(20, text_seed=1, image_seed=2),  # key A replayed, changed image
        setup.request(30, text_seed=2, image_seed=3),  # captures key B
        setup.request(40, text_seed=3, image_seed=4),  # captures key C, evicts A (LRU)
        setup.request(30, text_seed=5, image_seed=5),  # B survived: changed text and image
    ]
    survivor = None
    for index, request in enumerate(requests):
        graphed, eager = setup.logits_both(runner, request)
        assert graphed.shape[-1] == setup.model.config.vocab_size
        assert torch.equal(graphed, eager), f"request {index} differs from eager"
        if index == 2:
            survivor = runner.groups()[-1]
    stats = runner.stats()
    assert stats["captures"] == 3 and stats["evictions"] == 1, stats
    assert stats["replays"] == 5 and stats["fallbacks"] == {}, stats
    assert survivor is not None and not survivor.is_retired and survivor.replays == 2
    runner.close()


def test_evicting_a_three_segment_group_releases_its_graphs_stream_and_pool(device):
    setup = Setup(device, num_layers=2)  # 2 layers: 3 segments
    backend = CudaBackend(device)
    runner = SegmentedRunner(
        prefill_stages(setup.model, setup.kv),
        backend=backend,
        admission=EAGER_FIRST,
        max_bytes=1 << 40,
    )
    request = setup.request(24, text_seed=0, image_seed=0)
    setup.logits_both(runner, request)  # warm: the caller's own cuBLAS workspace
    runner.invalidate()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    setup.logits_both(runner, request)
    (group,) = runner.groups()
    entries, pool, stream = list(group.entries), group.pool, group.stream
    assert len(entries) == 3 and all(e.pool == pool and e.stream is stream for e in entries)
    assert backend.pool_reserved_bytes(pool) > 0
    assert runner.invalidate() == 1
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert all(e.is_retired and e.graph is None and e.static_args == [] for e in entries)
    assert group.pool_group.pool is None and group.pool_group.stream is None
    assert backend.pool_reserved_bytes(pool) == 0
    assert getattr(stream, "owned_handle", None) is None  # destroyed, not kept for reuse
    # the pool held the group's static inputs and its workspace: nothing is left behind
    assert torch.cuda.memory_reserved(device) <= reserved_before + (2 << 20)
    runner.close()


def test_a_1mib_budget_serves_every_image_request_eagerly_and_correctly(device):
    setup = Setup(device, num_layers=2)
    runner = setup.runner(1 << 20)
    reserved = torch.cuda.memory_reserved(device)
    for seed, num_text in enumerate((20, 20, 30)):
        graphed, eager = setup.logits_both(runner, setup.request(num_text, seed, seed))
        assert torch.equal(graphed, eager)
    stats = runner.stats()
    assert stats["groups"] == 0 and stats["resident_bytes"] == 0
    assert stats["fallbacks"] == {"over_budget": 3}, stats
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(device) <= reserved + (64 << 20)
    runner.close()
