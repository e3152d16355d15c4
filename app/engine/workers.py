"""Local tensor-parallel ranks: rank 0 is this process, ranks 1..N-1 are spawned processes.

`start_local_workers(config)` spawns the workers (torch.multiprocessing, "spawn"), joins the
process group as rank 0 and returns the `TPDriver` the engine drives them with. Each worker
builds only its model and KV cache shard (`RankWorker`, app/engine/shard.py) and loops in
`serve_rank`. gloo on CPU; NCCL on CUDA (rank r on cuda:r) plus a gloo group for messages.
Ray Serve replicas start the same `worker_main` in Ray actors instead (app/serve/tp_*.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.config import EngineConfig
from app.engine.shard import RankWorker
from app.engine.tp_driver import TPDriver, serve_rank
from app.models.parallel import TPContext

log = logging.getLogger(__name__)
# Bounds every collective: a rank that stops answering becomes an error, not a hang. Loading a
# large checkpoint happens between two collectives, so it must fit too.
TIMEOUT_S = float(os.environ.get("SLIMSERVE_TP_TIMEOUT_S", "600"))
# "spawn" (default) or "forkserver": the latter imports torch and the engine once in a server
# process and forks each worker from it (tests start many small replicas).
START_METHOD = os.environ.get("SLIMSERVE_TP_START_METHOD", "spawn")


def rendezvous_file() -> str:
    """A fresh FileStore path: local ranks meet through a file, so no port can be taken."""
    return os.path.join(tempfile.gettempdir(), f"slimserve-tp-{uuid.uuid4().hex}")


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    device = config.resolved_device()
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def init_rank(config: EngineConfig, rank: int, init_method: str, device: torch.device):
    """Joins the replica's process group -> (TPContext, group for control messages)."""
    size = config.tensor_parallel_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    ctx = TPContext(rank, size, dist.group.WORLD, config.enable_expert_parallel)
    return ctx, control


def worker_main(rank: int, config: EngineConfig, init_method: str, local_rank: int) -> None:
    """Entry point of a worker rank (a spawned process or a Ray actor's thread)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # ranks share the host's cores
    device = rank_device(config, local_rank)
    ctx, control = init_rank(config, rank, init_method, device)
    try:
        serve_rank(RankWorker(config, ctx, device), control)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, config: EngineConfig, init_method: str) -> None:
    worker_main(rank, config, init_method, local_rank=rank)


def start_local_workers(config: EngineConfig) -> TPDriver:
    if dist.is_initialized():  # torch allows one default process group per process
        raise RuntimeError(
            "a tensor-parallel engine is still running in this process: shut it down first "
            "(LLM.shutdown(), `with LLM(...) as llm:`, or drop every reference to it)"
        )
    size = config.tensor_parallel_size
    store = rendezvous_file()
    init_method = f"file://{store}"
    spawn = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        spawn.set_forkserver_preload(["app.engine.shard", "app.engine.workers"])
    procs = [
        spawn.Process(target=_spawned, args=(r, config, init_method), daemon=True)
        for r in range(1, size)
    ]
    for p in procs:
        p.start()
    device = rank_device(config, 0)
    try:
        ctx, control = init_rank(config, 0, init_method, device)
    except BaseException:
        _stop(procs, 0)
        raise

    def dead_workers() -> list[str]:
        return [
            f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(procs, 1)
            if not p.is_alive()
        ]

    def close() -> None:
        _stop(procs, 30)
        if dist.is_initialized():
            dist.destroy_process_group()
        with contextlib.suppress(FileNotFoundError):
            os.remove(store)

    driver = TPDriver(ctx, device, control, dead_workers, close)
    driver.worker_pids = [p.pid for p in procs]
    return driver


def _stop(procs: list[Any], wait_s: float) -> None:
    for p in procs:
        p.join(wait_s)
        if p.is_alive():
            log.warning("tensor-parallel worker pid %s did not exit; terminating", p.pid)
            p.terminate()
            p.join(5)
