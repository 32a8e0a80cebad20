"""`launch_engines`: engine actors placed on a Ray cluster, one placement-group bundle per
engine (its CPUs, and on GPUs its GPU), all started and loaded before it returns.

With `tensor_parallel_size` > 1 in the engine arguments each engine gets a placement group
of its own, as vLLM gives each data-parallel rank: one bundle per tensor-parallel rank
(the engine's CPUs and GPUs shared out), STRICT_PACK since the ranks meet on the node's
loopback, named as a tensor-parallel group (`ranks.GROUP_PREFIX`); the engine actor
(rank 0) sits on bundle 0 and starts its worker ranks as actors on the others."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hotswap.errors import InvalidArgument
from hotswap.ray.actor import EngineActor
from hotswap.ray.ranks import GROUP_PREFIX

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class EngineActors:
    """The launched engines: `handles[i]` is engine i, named `names[i]`; iterate or index
    it as a list of handles. `shutdown()` stops them and frees their placement group."""

    handles: list[ActorHandle]
    names: list[str]
    placement_group: PlacementGroup | None  # None with tensor parallelism: one per engine
    owns_placement_group: bool = field(default=True, repr=False)
    # with tensor parallelism: engine i's group (its ranks' bundles), made here
    tensor_parallel_groups: list[PlacementGroup] = field(default_factory=list)

    def __iter__(self) -> Iterator[ActorHandle]:
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, index: int) -> ActorHandle:
        return self.handles[index]

    def shutdown(self) -> None:
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        if self.placement_group is not None and self.owns_placement_group:
            remove_placement_group(self.placement_group)
        for group in self.tensor_parallel_groups:
            remove_placement_group(group)


def launch_engines(
    num_engines: int,
    model: str | None = None,
    engine_args: dict[str, Any] | None = None,
    *,
    num_cpus_per_engine: float = 1,
    num_gpus_per_engine: float = 0,
    placement: str | PlacementGroup = "PACK",
    name_prefix: str = "hotswap-engine",
    max_restarts: int = 0,
    ready_timeout_s: float = 600.0,
) -> EngineActors:
    """Start `num_engines` `EngineActor`s serving `model` with `engine_args` (AsyncLLM's
    keyword arguments). `placement`: a strategy for a new placement group (PACK keeps
    engines on few nodes, SPREAD on many) or an existing group with one bundle per engine.
    CPU engines get `num_threads = num_cpus_per_engine` (at least 1); with GPUs the device
    defaults to `cuda` (Ray gives each actor its own GPU). `max_restarts`: Ray restarts a
    dead engine that many times, from `model` (send it the current weights next round)."""
    _check(num_engines, num_cpus_per_engine, num_gpus_per_engine, max_restarts)
    args = dict(engine_args or {})
    if num_gpus_per_engine:
        args.setdefault("device", "cuda")
    else:  # torch threads: the engine's CPUs (at least one)
        args.setdefault("num_threads", max(1, int(num_cpus_per_engine)))
    ranks = _tensor_parallel_size(args, placement)
    if ranks > 1:
        args.setdefault("distributed_executor_backend", "ray")  # workers on bundles 1..
    # one engine's bundle, or with tensor parallelism each of its ranks'
    bundle = {"CPU": num_cpus_per_engine / ranks,
              **({"GPU": num_gpus_per_engine / ranks} if num_gpus_per_engine else {})}  # fmt: skip
    suffix = uuid.uuid4().hex[:8]
    engines = _place(num_engines, ranks, bundle, placement, suffix, ready_timeout_s)
    remote = ray.remote(EngineActor)
    for i in range(num_engines):
        group, index = _engine_bundle(engines, i)
        engines.names.append(f"{name_prefix}-{i}-{suffix}")
        engines.handles.append(remote.options(
            name=engines.names[i],
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_restarts=max_restarts,
            max_concurrency=1000,  # concurrent requests and control calls on one loop
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
        ).remote(model, args))  # fmt: skip
    try:
        ray.get([h.ready.remote() for h in engines.handles], timeout=ready_timeout_s)
    except BaseException:
        engines.shutdown()
        raise
    return engines


def _place(count: int, ranks: int, bundle: dict[str, float], placement: str | PlacementGroup,
           suffix: str, timeout_s: float) -> EngineActors:  # fmt: skip
    """The engines' placement, before any is started: one group with a bundle per engine,
    or with tensor parallelism a group per engine with a bundle per rank."""
    if ranks == 1:
        group, owned = _placement_group(placement, count, bundle, timeout_s)
        return EngineActors([], [], group, owned)
    engines = EngineActors([], [], None)
    try:
        for i in range(count):
            engines.tensor_parallel_groups.append(_reserve(
                [bundle] * ranks, "STRICT_PACK", f"{GROUP_PREFIX}{suffix}-{i}", timeout_s
            ))  # fmt: skip
    except BaseException:
        engines.shutdown()
        raise
    return engines


def _engine_bundle(engines: EngineActors, i: int) -> tuple[PlacementGroup, int]:
    """Engine i's bundle: bundle i of the engines' group, or bundle 0 of its own."""
    if engines.tensor_parallel_groups:
        return engines.tensor_parallel_groups[i], 0
    assert engines.placement_group is not None
    return engines.placement_group, i


def _tensor_parallel_size(args: dict[str, Any], placement: str | PlacementGroup) -> int:
    """The engines' tensor-parallel ranks; with several, each engine's own STRICT_PACK
    group replaces `placement`, which may then only ask to pack."""
    ranks = args.get("tensor_parallel_size", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise InvalidArgument("tensor_parallel_size", "tensor_parallel_size: must be a "
                              f"positive integer, got {ranks!r}")  # fmt: skip
    if ranks > 1 and placement not in ("PACK", "STRICT_PACK"):
        raise InvalidArgument(
            "placement",
            f"placement: {placement!r} with tensor_parallel_size {ranks}: each engine gets a "
            "STRICT_PACK placement group of its own (its ranks meet on one node); use PACK",
        )
    return ranks


def _placement_group(
    placement: str | PlacementGroup, count: int, bundle: dict[str, float], timeout_s: float
) -> tuple[PlacementGroup, bool]:
    """The group to place engines in, and whether it is ours to remove."""
    if isinstance(placement, PlacementGroup):
        if len(placement.bundle_specs) < count:
            raise InvalidArgument(
                "placement",
                f"placement: the placement group has {len(placement.bundle_specs)} bundles, "
                f"{count} engines need one each",
            )
        return placement, False
    if placement not in STRATEGIES:
        raise InvalidArgument(
            "placement",
            f"placement: {placement!r}; choose from {', '.join(STRATEGIES)} "
            "or pass a PlacementGroup",  # fmt: skip
        )
    return _reserve([bundle] * count, placement, "", timeout_s), True


def _reserve(
    bundles: list[dict[str, float]], strategy: str, name: str, timeout_s: float
) -> PlacementGroup:
    group = placement_group([dict(b) for b in bundles], strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"launch_engines: the cluster cannot place {len(bundles)} bundle(s) of "
            f"{bundles[0]} ({strategy}) within {timeout_s} s (available: "
            f"{ray.available_resources()})"
        )
    return group


def _check(count: int, cpus: float, gpus: float, restarts: int) -> None:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise InvalidArgument("num_engines", f"num_engines: must be a positive integer, "
                                             f"got {count!r}")  # fmt: skip
    if not isinstance(cpus, (int, float)) or cpus < 0 or (cpus == 0 and not gpus):
        raise InvalidArgument("num_cpus_per_engine", "num_cpus_per_engine: must be positive "
                                                     f"(got {cpus!r})")  # fmt: skip
    if not isinstance(gpus, (int, float)) or gpus < 0:
        raise InvalidArgument("num_gpus_per_engine", "num_gpus_per_engine: must be >= 0 "
                                                     f"(got {gpus!r})")  # fmt: skip
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < -1:
        raise InvalidArgument("max_restarts", "max_restarts: an integer >= -1 (-1: always)")
