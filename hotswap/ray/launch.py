"""`launch_engines`: engine actors placed on a Ray cluster, one placement-group bundle per
engine (its CPUs, and on GPUs its GPU), all started and loaded before it returns."""

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

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class EngineActors:
    """The launched engines: `handles[i]` is engine i, named `names[i]`; iterate or index
    it as a list of handles. `shutdown()` stops them and frees their placement group."""

    handles: list[ActorHandle]
    names: list[str]
    placement_group: PlacementGroup | None
    owns_placement_group: bool = field(default=True, repr=False)

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
    group, owned = _placement_group(placement, num_engines, num_cpus_per_engine,
                                    num_gpus_per_engine, ready_timeout_s)  # fmt: skip
    suffix = uuid.uuid4().hex[:8]
    names = [f"{name_prefix}-{i}-{suffix}" for i in range(num_engines)]
    remote = ray.remote(EngineActor)
    handles = [
        remote.options(
            name=name,
            num_cpus=num_cpus_per_engine,
            num_gpus=num_gpus_per_engine,
            max_restarts=max_restarts,
            max_concurrency=1000,  # concurrent requests and control calls on one loop
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle_index),
        ).remote(model, args)
        for bundle_index, name in enumerate(names)
    ]
    engines = EngineActors(handles, names, group, owned)
    try:
        ray.get([h.ready.remote() for h in handles], timeout=ready_timeout_s)
    except BaseException:
        engines.shutdown()
        raise
    return engines


def _placement_group(
    placement: str | PlacementGroup, count: int, cpus: float, gpus: float, timeout_s: float
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
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = placement_group([dict(bundle) for _ in range(count)], strategy=placement)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"launch_engines: the cluster cannot place {count} engine(s) of {bundle} within "
            f"{timeout_s} s (available: {ray.available_resources()})"
        )
    return group, True


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
