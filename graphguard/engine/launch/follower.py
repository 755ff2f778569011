"""A follower rank: its shard, its KV, its graphs, and a loop over rank 0's messages.

A follower has no scheduler, tokenizer or server. It runs each batch rank 0 sends through a
ModelRunner of its own (the same calls in the same order, so the same collectives), carries out
every graph decision rank 0 sends, between steps and in the decode call, and ends on Shutdown.
Its logits are dropped: rank 0 samples.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from graphguard.core.decisions import Decision
from graphguard.core.export import model_identity
from graphguard.engine.config import EngineConfig
from graphguard.engine.graphs.component import EngineGraphs
from graphguard.engine.models.forward import EagerForward
from graphguard.engine.models.loader import LoadedModel
from graphguard.engine.parallel.ranks import BatchMessage, RankRole, RanksLost, Shutdown
from graphguard.engine.scheduling.kv_sizing import kv_storage
from graphguard.engine.shapes import warmup_shapes
from graphguard.engine.step.model_runner import ModelRunner
from graphguard.kernels import select_kernels

log = logging.getLogger("graphguard")


class Follower:
    """Rank > 0 (see module docstring). `num_blocks` and `graphs_on` are rank 0's."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        role: RankRole,
        *,
        num_blocks: int,
        graphs_on: bool,
        max_model_len: int,
    ) -> None:
        model, mc = loaded.model, loaded.config
        weight = next(model.parameters())
        device, dtype = weight.device, weight.dtype
        kernels = select_kernels(config.kernels, device, dtype).kernels
        model.use_kernels(kernels)
        kernels.prepare(model)
        self.kv = kv_storage(mc, num_blocks, config.block_size, device, dtype)
        forward = EagerForward(model, self.kv)
        # NOTE: graphs follow rank 0's capability, not this rank's environment: the ranks
        # must hold the same runners whatever a follower's kill switch says.
        self.graphs: EngineGraphs | None = None
        if graphs_on:
            identity = model_identity(loaded.name, mc, dtype=dtype, block_size=config.block_size)
            self.graphs = EngineGraphs(config.graphs, forward, device, identity, role)
            self.graphs.start(warmup_shapes(config, max_model_len))
        self.runner = ModelRunner(
            forward, device, graphs=self.graphs, pad_prefills=config.graphs.prefill
        )

    def handle(self, message: Any) -> bool:
        """Carry out one message of rank 0; False once it said Shutdown."""
        if isinstance(message, Shutdown):
            return False
        if isinstance(message, Decision):  # between steps: the capture in flight
            if self.graphs is None:
                raise RanksLost("rank 0 sent a graph decision, but this rank has no graphs")
            self.graphs.decode.follow_between_calls(message)
        elif isinstance(message, BatchMessage):
            with torch.no_grad():
                self.runner.run(message.rebuild())
        else:
            raise RanksLost(f"unknown message from rank 0: {type(message).__name__}")
        return True

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        self.kv.release()

    def stats(self) -> dict[str, Any] | None:
        return self.graphs.stats() if self.graphs is not None else None
