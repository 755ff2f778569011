"""Starting tensor-parallel ranks: one process per rank, rank 0 in the calling process.

`start_ranks` spawns ranks 1..N-1 (torch.multiprocessing, spawn), joins them in one process
group (NCCL on CUDA with one device per rank, gloo on CPU) plus a gloo group for messages,
loads the model on each rank and keeps the rank's shard, and returns rank 0's LLMEngine. The
followers loop on rank 0's messages (graphguard/engine/launch/follower.py) until it shuts
down. Every group carries `collective_timeout_s`; a follower that exits or stops answering
ends rank 0's next step with RanksLost, and rank 0's exit ends the followers.

NCCL_NVLS_ENABLE=0 is set for every rank: NVLink multicast (NVLS) buffers are large and have
failed to allocate on shared hosts; the all-reduces here are small.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphguard.engine.config import EngineConfig
from graphguard.engine.engine import LLMEngine, resolve_device
from graphguard.engine.launch.follower import Follower
from graphguard.engine.models.loader import LoadedModel, load_model, resolve_dtype
from graphguard.engine.models.parallel_layers import ModelShard
from graphguard.engine.models.shard import build_shard, model_shard, shard_plan
from graphguard.engine.parallel.ranks import (
    Channel,
    GroupAgreement,
    LeaderLink,
    RanksLost,
    follower_role,
    gather_reports,
)

log = logging.getLogger("graphguard")
RANK_ENV = {"NCCL_NVLS_ENABLE": "0"}


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What every rank is started with."""

    config: EngineConfig
    world_size: int
    port: int
    timeout_s: float
    # the whole model on the CPU (a picklable function, run on every rank; None: load_model
    # of config.model): benchmarks give random weights of a preset's shapes, seeded alike
    load_whole: Callable[[], LoadedModel] | None = None


class FollowerProcesses:
    """Ranks 1..N-1 as child processes of rank 0."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes

    def check(self) -> None:
        """RanksLost naming the first follower that has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RanksLost(f"tensor-parallel rank {rank} exited (code {process.exitcode})")

    def join(self, timeout_s: float) -> None:
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()  # NOTE: a rank stuck in a collective ends here, not hangs


def start_ranks(
    config: EngineConfig,
    follower: Callable[[int, RankSetup], None] | None = None,
    load_whole: Callable[[], LoadedModel] | None = None,
) -> tuple[LLMEngine, FollowerProcesses]:
    """Rank 0's engine over its shard, with ranks 1..N-1 running `follower` (default:
    follower_main; tests inject faults through their own) (see module docstring)."""
    world_size = config.tensor_parallel_size
    setup = RankSetup(config, world_size, _free_port(), config.collective_timeout_s, load_whole)
    os.environ.update(RANK_ENV)  # NOTE: before spawning: the followers inherit it
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=follower or follower_main, args=(rank, setup), daemon=True)
        for rank in range(1, world_size)
    ]
    for process in processes:
        process.start()
    followers = FollowerProcesses(processes)
    control, device = join_group(0, setup)
    loaded = load_shard(setup, 0, device)
    channel = Channel(control, followers.check)
    link = LeaderLink(channel, GroupAgreement(control, world_size))
    engine = LLMEngine(rank_config(config, device), loaded, link)
    channel.send((engine.kv.num_blocks, engine.graphs is not None, engine.max_model_len))
    return engine, followers


def follower_main(rank: int, setup: RankSetup) -> None:
    """A follower process: join, load its shard, follow rank 0 until Shutdown."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(levelname)s %(message)s")
    try:
        control, device = join_group(rank, setup)
        loaded = load_shard(setup, rank, device)
        channel = Channel(control)
        role = follower_role(channel, GroupAgreement(control, setup.world_size))
        num_blocks, graphs_on, max_model_len = channel.receive()
        config = rank_config(setup.config, device)
        follower = Follower(
            config,
            loaded,
            role,
            num_blocks=num_blocks,
            graphs_on=graphs_on,
            max_model_len=max_model_len,
        )
        while follower.handle(channel.receive()):
            pass
        gather_reports(control, follower.stats())
        follower.close()
        dist.destroy_process_group()
    except RanksLost as exc:
        log.error("tensor-parallel rank %d ends: %s", rank, exc)
        sys.exit(1)


def join_group(rank: int, setup: RankSetup) -> tuple[Any, torch.device]:
    """Join the device group (NCCL on CUDA, gloo on CPU) and make the gloo control group."""
    device = resolve_device(setup.config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=setup.timeout_s)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{setup.port}",
        rank=rank,
        world_size=setup.world_size,
        timeout=timeout,
    )
    return dist.new_group(backend="gloo", timeout=timeout), device


def load_shard(setup: RankSetup, rank: int, device: torch.device) -> LoadedModel:
    """The whole model loaded on the CPU, this rank's shard of it on `device`."""
    dtype = resolve_dtype(setup.config.dtype, device)
    if setup.load_whole is not None:
        whole = setup.load_whole()
    else:
        whole = load_model(setup.config.model, dtype=dtype, device="cpu", progress=rank == 0)
    shard: ModelShard = model_shard(whole.config, setup.world_size, rank, None)
    weights = whole.model.state_dict()
    model = build_shard(whole.config, weights, shard, dtype=dtype, device=device)
    local = shard_plan(whole.config, setup.world_size, rank).local_config(whole.config)
    return dataclasses.replace(whole, model=model, config=local)


def rank_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    """The rank's engine settings: its own device."""
    return dataclasses.replace(config, device=str(device))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
