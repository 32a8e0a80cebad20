"""Tensor-parallel worker ranks as Ray actors: `--distributed-executor-backend ray` (the
default with `--data-parallel-backend ray`).

Rank 0 stays in the engine core; ranks 1.. are `TPWorkerActor`s running the same loop as
the worker processes (`hotswap.execution.rank_process.run_rank`). They join rank 0's store on
127.0.0.1, so they run on rank 0's node: on bundles 1.. of its placement group when the
core is rank 0 of a tensor-parallel group's placement group (one per data-parallel rank,
`hotswap.ray.dp`), else pinned to its node. Each actor given a GPU sees it as `cuda:0`.
"""

from __future__ import annotations

import contextlib
import signal
import uuid

import ray
import torch.distributed as dist
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from hotswap.config import EngineConfig
from hotswap.execution.ranks import HOST, WorkerHandle

# The name of a placement group whose bundle i is tensor-parallel rank i of one core.
GROUP_PREFIX = "hotswap-tp-"


class TPWorkerActor:
    """One worker rank. Made remote with options by `start_actors`."""

    def __init__(self) -> None:
        with contextlib.suppress(ValueError):  # the front-end owns our shutdown
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def run(self, port: int, rank: int, size: int) -> int:
        from hotswap.execution.rank_process import run_rank

        return run_rank(HOST, port, rank, size)


class RayWorker:
    """A worker rank's actor and the ObjectRef of its `run` (ready once it ended)."""

    def __init__(self, actor: ActorHandle, run_ref: ray.ObjectRef) -> None:
        self.actor = actor
        self.run_ref = run_ref

    def exit_code(self) -> int | None:
        ready, _ = ray.wait([self.run_ref], timeout=0)
        if not ready:
            return None
        try:
            return int(ray.get(self.run_ref))
        except Exception:  # noqa: BLE001 - the actor died or `run` raised
            return 1

    def wait(self, timeout_s: float) -> bool:
        ready, _ = ray.wait([self.run_ref], timeout=timeout_s)
        return bool(ready)

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already dead, or Ray shut down
            ray.kill(self.actor, no_restart=True)


def start_actors(
    store: dist.Store, port: int, size: int, config: EngineConfig
) -> list[WorkerHandle]:
    """The "ray" launcher (`hotswap.execution.ranks.LAUNCHERS`)."""
    if not ray.is_initialized():  # rank 0 outside Ray: join a running cluster or start one
        ray.init()
    gpu = config.device.startswith("cuda")
    threads = int(store.get("threads"))
    group = tensor_parallel_group(size)
    remote = ray.remote(TPWorkerActor)
    tag = uuid.uuid4().hex[:8]
    workers: list[WorkerHandle] = []
    for rank in range(1, size):
        store.set(f"device{rank}", "cuda:0" if gpu else config.device)
        # on a bundle: what it holds (its group sized it); else its threads, its GPU
        bundle = group.bundle_specs[rank] if group is not None else {}
        actor = remote.options(
            name=f"hotswap-tp-rank-{rank}-{tag}",
            num_cpus=bundle.get("CPU", threads),
            num_gpus=bundle.get("GPU", 1 if gpu else 0),
            max_restarts=0,  # a dead rank stops its engine; it does not come back
            scheduling_strategy=_placement(group, rank),
        ).remote()
        workers.append(RayWorker(actor, actor.run.remote(port, rank, size)))
    return workers


def tensor_parallel_group(size: int) -> PlacementGroup | None:
    """This actor's placement group when it is a tensor-parallel group of `size` ranks
    (then this actor is rank 0, on bundle 0); None otherwise."""
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) != size:
        return None
    name = ray.util.placement_group_table(group).get("name", "")
    return group if name.startswith(GROUP_PREFIX) else None


def _placement(
    group: PlacementGroup | None, rank: int
) -> PlacementGroupSchedulingStrategy | NodeAffinitySchedulingStrategy:
    if group is not None:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    node = ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)
