"""Session fixtures for the engine's model tests: the real embedded model and a tiny Qwen3.

The embedded model loads through the regular user cache (``GRAPHGUARD_CACHE_DIR`` to move it):
the first session converts the GGUF file (about half a minute), later sessions take a second.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from graphguard.engine.models.loader import LoadedModel, load_model

# Nothing in these tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    """SmolLM2-135M-Instruct in float32 on CPU, loaded once per session (float32 named: the
    engine tests compare with float32 references, whatever this CPU's default dtype is)."""
    return load_model(None, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def hf_embedded(embedded_model: LoadedModel) -> Any:
    """The transformers reference model, read from the same converted folder."""
    from transformers import AutoModelForCausalLM

    assert embedded_model.folder is not None
    model = AutoModelForCausalLM.from_pretrained(embedded_model.folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_qwen3_folder(
    tmp_path_factory: pytest.TempPathFactory, embedded_model: LoadedModel
) -> Path:
    """A Hugging Face folder holding a tiny random Qwen3 (seeded) and the SmolLM2 tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    assert embedded_model.folder is not None
    for name in TOKENIZER_FILES:
        shutil.copy(embedded_model.folder / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_qwen3_folder: Path) -> LoadedModel:
    return load_model(str(tiny_qwen3_folder), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def hf_tiny_qwen3(tiny_qwen3_folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_folder, dtype=torch.float32).eval()


class PagedDriver:
    """Drives a DecoderModel over PagedKVStorage as an engine would, for the model tests.

    Packed prefill (possibly on top of cached tokens), then batched one-token decode steps
    with block tables padded to a common width.
    """

    def __init__(self, model: Any, *, block_size: int = 4, num_blocks: int = 256) -> None:
        from graphguard.engine.scheduling.kv import PagedKVStorage

        config, weight = model.config, model.embed_tokens.weight
        self.model = model
        self.block_size = block_size
        self.kv = PagedKVStorage(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
        )

    def new_table(self, max_tokens: int) -> list[int]:
        return self.kv.allocate(-(-max_tokens // self.block_size))

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def prefill(
        self, tables: list[list[int]], chunks: list[list[int]], num_cached: list[int]
    ) -> torch.Tensor:
        """Logits ``[sum(len(chunk)), vocab]`` of each chunk, which follows num_cached tokens."""
        from graphguard.engine.models.attention import AttentionMetadata

        positions = [list(range(n, n + len(c))) for n, c in zip(num_cached, chunks, strict=True)]
        seq_lens = [n + len(c) for n, c in zip(num_cached, chunks, strict=True)]
        query_lens = [len(c) for c in chunks]
        slots = [self.slot(t, p) for t, ps in zip(tables, positions, strict=True) for p in ps]
        meta = AttentionMetadata(
            packed=True,
            slot_mapping=self._long(slots),
            block_tables=self._tables(tables, max(len(t) for t in tables)),
            seq_lens=self._int(seq_lens),
            query_start_loc=self._int([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        ids = self._long([i for c in chunks for i in c])
        with torch.no_grad():
            hidden = self.model(ids, self._long([p for ps in positions for p in ps]), meta, self.kv)
            return self.model.compute_logits(hidden)

    def decode(
        self,
        tables: list[list[int]],
        tokens: list[int],
        positions: list[int],
        *,
        width: int | None = None,
        num_pad_rows: int = 0,
    ) -> torch.Tensor:
        """Logits ``[len(tokens) + num_pad_rows, vocab]`` of one decode step."""
        from graphguard.engine.models.attention import AttentionMetadata
        from graphguard.engine.scheduling.kv import PagedKVStorage

        dummy = PagedKVStorage.DUMMY_BLOCK
        width = width or max(len(t) for t in tables)
        num_real = len(tokens)
        slots = [self.slot(t, p) for t, p in zip(tables, positions, strict=True)]
        meta = AttentionMetadata(
            packed=False,
            slot_mapping=self._long(slots + [0] * num_pad_rows),
            block_tables=self._tables(tables + [[dummy]] * num_pad_rows, width),
            seq_lens=self._int([p + 1 for p in positions] + [1] * num_pad_rows),
            query_start_loc=self._int(list(range(num_real + num_pad_rows + 1))),
        )
        ids = self._long(tokens + [0] * num_pad_rows)
        with torch.no_grad():
            hidden = self.model(ids, self._long(positions + [0] * num_pad_rows), meta, self.kv)
            return self.model.compute_logits(hidden)

    def greedy(self, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of all prompts, prefilled together and decoded as one batch."""
        tables = [self.new_table(len(p) + num_new_tokens) for p in prompts]
        logits = self.prefill(tables, prompts, [0] * len(prompts))
        last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        outputs = [[int(t)] for t in logits[last_rows].argmax(-1)]
        for step in range(num_new_tokens - 1):
            positions = [len(p) + step for p in prompts]
            logits = self.decode(tables, [out[-1] for out in outputs], positions)
            for out, token in zip(outputs, logits.argmax(-1).tolist(), strict=True):
                out.append(int(token))
        return outputs

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.kv.k_cache[0].device)

    def _int(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.kv.k_cache[0].device)

    def _tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        from graphguard.engine.scheduling.kv import PagedKVStorage

        padded = [t + [PagedKVStorage.DUMMY_BLOCK] * (width - len(t)) for t in tables]
        return self._int(padded)


def hf_greedy(hf_model: Any, prompt: list[int], num_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (may stop early at an eos token)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.fixture(scope="session")
def paged_driver() -> type[PagedDriver]:
    return PagedDriver


@pytest.fixture(scope="session")
def hf_greedy_fn() -> Any:
    return hf_greedy
