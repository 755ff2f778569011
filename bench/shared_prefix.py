"""A shared-prefix serving load: clients that all send one long document (a system prompt, a
shared file) followed by short questions of their own, with the engine's prefix caching on
and off (EngineConfig.prefix_caching). Run from bench/long_context.py.

Each of `clients` clients asks `rounds` questions in turn, the next as soon as its last is
answered (a closed loop, all clients starting together), after an untimed round on another
document. TTFT is the time from a request's submission to the engine step that returns its
first token. The engine is driven in process by the `LLM`'s engine, as the server's engine
thread drives it (graphguard/server/async_engine.py), without HTTP or an event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.timing import percentile
from graphguard.engine.config import EngineConfig
from graphguard.engine.llm import LLM
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.tokens.sampling import SamplingParams


@dataclass(frozen=True)
class SharedLoad:
    """The load's shape; the defaults are the long-context bench's."""

    clients: int = 16
    rounds: int = 4
    prefix: int = 4096  # tokens of the shared document
    question: int = 32  # tokens of each client's question
    answer_tokens: int = 16
    batched_tokens: int = 0  # EngineConfig.max_num_batched_tokens (0: the engine's default)
    eager: bool = False


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` random token ids (no special tokens), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (num, length), generator=g).tolist()


def shared_prefix(loaded: LoadedModel, load: SharedLoad, caching: bool) -> dict:
    """TTFT p50 / p99 (ms) of the load on a fresh engine with prefix caching on or off."""
    block_size = EngineConfig().block_size
    length = load.prefix + load.question + load.answer_tokens
    blocks = load.clients * (-(-length // block_size) + 1) + 2 * (load.prefix // block_size)
    llm = LLM(
        loaded, max_model_len=length + block_size, max_num_seqs=load.clients,
        num_kv_blocks=blocks + 8, max_num_batched_tokens=load.batched_tokens,
        prefix_caching=caching, enforce_eager=load.eager,
    )  # fmt: skip
    try:
        vocab = loaded.config.vocab_size
        closed_loop(llm, random_prompts(1, load.prefix, vocab, seed=1)[0], load, rounds=1)
        ttfts = closed_loop(llm, random_prompts(1, load.prefix, vocab, seed=2)[0], load)
        stats = llm.engine.stats()["prefix_cache"] or {}
    finally:
        llm.shutdown()
    return dict(
        prefix_caching=caching, clients=load.clients, rounds=load.rounds,
        prefix_tokens=load.prefix, question_tokens=load.question,
        answer_tokens=load.answer_tokens, requests=len(ttfts),
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
        ttft_mean_ms=sum(ttfts) / len(ttfts), prefix_cache=stats,
    )  # fmt: skip


def closed_loop(
    llm: LLM, document: list[int], load: SharedLoad, rounds: int | None = None
) -> list[float]:
    """Every client's questions after `document`, each asked as soon as the client's last is
    answered -> TTFT of every request in ms."""
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    rounds = load.rounds if rounds is None else rounds
    params = SamplingParams(temperature=0.0, max_tokens=load.answer_tokens, ignore_eos=True)
    questions = random_prompts(load.clients * rounds, load.question, vocab, seed=document[0])
    submitted: dict[str, float] = {}
    ttfts: list[float] = []

    def ask(client: int, turn: int) -> None:
        request_id = f"c{client}-t{turn}-{time.monotonic_ns()}"
        engine.add_request(request_id, document + questions[client * rounds + turn], params)
        submitted[request_id] = time.perf_counter()

    for client in range(load.clients):
        ask(client, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in submitted and out.new_token_ids:
                ttfts.append(1e3 * (time.perf_counter() - submitted.pop(out.request_id)))
            if out.finished:
                client, turn = (int(part[1:]) for part in out.request_id.split("-")[:2])
                if turn + 1 < rounds:
                    ask(client, turn + 1)
    return ttfts
