"""How far one way of running a model is from another: next-token distributions over a text.

Two numerically different paths (float32, bfloat16, 4-bit GEMMs; one CPU's instruction set
or another's) never agree bit for bit, and a greedy answer that starts on a near-tie can
follow either path's first word. So they are compared over many positions instead: the text is
scored in windows through the engine's own prefill (every position's logits, as a prompt's
are), and each position's next-token distribution is compared with the reference's:

- ``kl``: mean KL(reference || path) in nats, the information the path loses per token;
- ``top1``: the share of positions whose most likely next token is the reference's;
- ``logprob_diff``: mean |log p(actual next token)| difference, and ``nll_diff`` the signed
  mean (how much worse the path predicts the text; negative is better).

`score_text` gives a path's log-probabilities over a text through its prefill, `score_decode`
through its decode step (a prompt prefilled, then the text's next tokens fed one step at a
time, as generation runs them); `compare` the figures between two paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import resources

import torch
from torch import Tensor
from torch.nn import functional as F

from graphguard.engine.engine import LLMEngine
from graphguard.engine.models.attention import AttentionMetadata, plan_prefill_groups
from graphguard.engine.models.forward import eager_prefill

WINDOW_TOKENS = 512  # each window is scored from a fresh start, its first token unpredicted


@dataclass(frozen=True)
class Scored:
    """Log-probabilities ``[P, vocab]`` (float32) at P positions and the token that followed."""

    logprobs: Tensor
    targets: Tensor  # [P] int64


@dataclass(frozen=True)
class Fidelity:
    """A path's figures against a reference over the same positions (see module)."""

    positions: int
    kl: float
    top1: float
    logprob_diff: float
    nll_diff: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def corpus_text() -> str:
    """The fixed evaluation text the CPU paths are measured on (graphguard/data/corpus.txt)."""
    return resources.files("graphguard.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def score_text(engine: LLMEngine, text: str, window: int = WINDOW_TOKENS) -> Scored:
    """Every window's positions scored by `engine`'s model, its kernels and dtype."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    chunks = [ids[start : start + window] for start in range(0, len(ids), window)]
    parts = [_score_window(engine, chunk) for chunk in chunks if len(chunk) > 1]
    return Scored(
        logprobs=torch.cat([logprobs for logprobs, _ in parts]),
        targets=torch.cat([targets for _, targets in parts]),
    )


def score_decode(engine: LLMEngine, text: str, prompt_tokens: int, steps: int) -> Scored:
    """The log-probabilities of `steps` decode steps of one sequence: the text's first
    `prompt_tokens` tokens prefilled, then each next token of the text fed as the step's input
    (teacher forcing), so every path is scored on the same inputs."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[: prompt_tokens + steps + 1]
    if len(ids) < prompt_tokens + steps + 1:
        raise ValueError(f"the text has fewer than {prompt_tokens + steps + 1} tokens")
    tokens = torch.tensor(ids, dtype=torch.int64, device=engine.device)
    with _fresh_sequence(engine, len(ids)) as (table, positions, slots), torch.no_grad():
        eager_prefill(
            engine.model, engine.kv, tokens[:prompt_tokens], positions[:prompt_tokens],
            _prefill_meta(table, slots[:prompt_tokens]), None,
        )  # fmt: skip
        rows = [
            engine.forward.decode(
                tokens[t : t + 1],
                positions[t : t + 1],
                table,
                torch.tensor([t + 1], dtype=torch.int32, device=engine.device),
                slots[t : t + 1],
            )  # fmt: skip
            for t in range(prompt_tokens, prompt_tokens + steps)
        ]
    logprobs = F.log_softmax(torch.cat(rows).float(), dim=-1).cpu()
    return Scored(logprobs, tokens[prompt_tokens + 1 : prompt_tokens + steps + 1].cpu())


def compare(reference: Scored, path: Scored) -> Fidelity:
    """The figures of `path` against `reference` (the same text, so the same targets)."""
    if not torch.equal(reference.targets, path.targets):
        raise ValueError("the two scores are of different texts")
    ref, got = reference.logprobs, path.logprobs
    kl = (ref.exp() * (ref - got)).sum(dim=-1)
    rows, targets = torch.arange(len(reference.targets)), reference.targets
    ref_target, got_target = ref[rows, targets], got[rows, targets]
    return Fidelity(
        positions=len(rows),
        kl=float(kl.mean()),
        top1=float((ref.argmax(dim=-1) == got.argmax(dim=-1)).float().mean()),
        logprob_diff=float((got_target - ref_target).abs().mean()),
        nll_diff=float((ref_target - got_target).mean()),
    )


def _score_window(engine: LLMEngine, ids: list[int]) -> tuple[Tensor, Tensor]:
    """Log-probabilities of positions 0..n-2 of one fresh sequence, and tokens 1..n-1."""
    tokens = torch.tensor(ids, dtype=torch.int64, device=engine.device)
    with _fresh_sequence(engine, len(ids)) as (table, positions, slots), torch.no_grad():
        meta = _prefill_meta(table, slots)
        hidden = eager_prefill(engine.model, engine.kv, tokens, positions, meta, None)
        logits = engine.model.compute_logits(hidden[:-1])
    return F.log_softmax(logits.float(), dim=-1).cpu(), tokens[1:].cpu()


@contextmanager
def _fresh_sequence(engine: LLMEngine, num_tokens: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """KV blocks for one sequence of `num_tokens`, freed afterwards: its block table
    ``[1, blocks]``, positions and slots ``[num_tokens]``."""
    kv, device = engine.kv, engine.device
    blocks = kv.allocate(-(-num_tokens // kv.block_size))
    try:
        table = torch.tensor([blocks], dtype=torch.int32, device=device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
        slots = table[0, positions // kv.block_size].long() * kv.block_size
        yield table, positions, slots + positions % kv.block_size
    finally:
        kv.free(blocks)


def _prefill_meta(table: Tensor, slots: Tensor) -> AttentionMetadata:
    """The metadata of one fresh sequence's prefill of ``len(slots)`` tokens."""
    num_tokens, device = len(slots), table.device
    return AttentionMetadata(
        packed=True,
        slot_mapping=slots,
        block_tables=table,
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens_cpu=[num_tokens],
        query_lens_cpu=[num_tokens],
        prefill_groups=plan_prefill_groups([num_tokens], [num_tokens], device),
    )
