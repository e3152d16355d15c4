"""Tensor-parallel Serve replicas: worker ranks 1..N-1 as Ray actors beside the replica.

The replica actor is rank 0 (it runs the engine and drives the others, app/engine/tp_driver.py).
Its deployment asks Serve for a placement group of N bundles, STRICT_PACK (one node: the ranks
meet through a FileStore file and NCCL wants NVLink/PCIe peers), one GPU each on GPU replicas
and CPU bundles on CPU. The replica takes bundle 0; worker r is an actor in bundle r running
`worker_main` until rank 0 says stop. Each worker's `run()` ObjectRef doubles as its liveness
signal: it resolves only when the rank stopped, so a killed worker shows up at once in the
replica's health check, which then raises and Serve replaces the replica (its worker actors are
owned by it and die with it).
"""

from __future__ import annotations

import contextlib
import logging
import os

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.config import EngineConfig
from app.engine.tp_driver import TPDriver
from app.engine.workers import init_rank, rank_device, rendezvous_file, worker_main

log = logging.getLogger(__name__)


def tp_bundles(tp_size: int, num_cpus: float, num_gpus: float) -> list[dict[str, float]]:
    """One bundle per rank: a GPU each on GPU replicas, CPU only otherwise."""
    bundle = {"CPU": max(num_cpus, 0.01)}
    if num_gpus:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(tp_size)]


@ray.remote(max_concurrency=2)  # run() loops; pid() still answers
class TPWorkerActor:
    def run(self, rank: int, config: EngineConfig, init_method: str) -> None:
        worker_main(rank, config, init_method, local_rank=0)  # Ray sets CUDA_VISIBLE_DEVICES

    def pid(self) -> int:
        return os.getpid()


def start_ray_tp_group(config: EngineConfig, num_cpus: float, num_gpus: float, name: str):
    """Starts ranks 1..N-1 in the current placement group (or a new one) -> rank 0's driver."""
    size = config.tensor_parallel_size
    bundles = tp_bundles(size, num_cpus, num_gpus)
    pg, own_pg = get_current_placement_group(), False
    if pg is None:  # outside a Serve replica with placement_group_bundles (tests, scripts)
        pg, own_pg = placement_group(bundles, strategy="STRICT_PACK"), True
        ray.get(pg.ready(), timeout=120)
    store = rendezvous_file()
    init_method = f"file://{store}"
    actors, runs = [], []
    for rank in range(1, size):
        actor = TPWorkerActor.options(
            name=f"slimserve-tp:{name}:rank{rank}",
            num_cpus=bundles[rank]["CPU"],
            num_gpus=bundles[rank].get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank
            ),
        ).remote()
        actors.append(actor)
        runs.append(actor.run.remote(rank, config, init_method))
    device = rank_device(config, 0)
    ctx, control = init_rank(config, 0, init_method, device)

    def dead_workers() -> list[str]:
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        dead = []
        for rank, ref in enumerate(runs, 1):
            if ref in done:
                try:
                    ray.get(ref)
                    why = "stopped"
                except Exception as e:  # RayActorError when the actor was killed
                    why = f"died ({type(e).__name__})"
                dead.append(f"rank {rank} (Ray actor) {why}")
        return dead

    def close() -> None:
        ray.wait(runs, num_returns=len(runs), timeout=30)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        with contextlib.suppress(FileNotFoundError):
            os.remove(store)
        if own_pg:
            ray.util.remove_placement_group(pg)

    driver = TPDriver(ctx, device, control, dead_workers, close)
    driver.worker_names = [f"slimserve-tp:{name}:rank{r}" for r in range(1, size)]
    return driver
