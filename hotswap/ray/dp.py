"""Data-parallel engine cores as Ray actors: `hotswap serve --data-parallel-backend ray`.

The front-end's `DPEngineClient` routes requests and fans control calls out exactly as with
child processes; only where each rank runs differs. A rank is an `MPEngineClient` whose
`CoreRunner` is an `EngineCoreActor`: the front-end binds two TCP sockets on its node's IP
(random ports, since the actor may run on another node) and the actor's `run` connects to
them, says READY and serves until SHUTDOWN, as the child process does. The sockets are
CURVE servers (encrypted, and only a peer given the front-end's public key, through Ray,
can connect): anyone who reached a plain TCP port could otherwise take a share of the
requests a PUSH socket deals out, or forge outputs. The ObjectRef of `run` is the liveness
signal: once it is ready the core has ended or its actor has died. Each rank has its own
placement group (vLLM's layout): one bundle per tensor-parallel rank (STRICT_PACK: they
meet on the node's loopback), the core on bundle 0, its worker actors on the others
(`hotswap.ray.ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import uuid
from typing import Any

import ray
import zmq
from ray.actor import ActorClass, ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hotswap.engine.core_client import CoreRunner, EngineCoreClient, MPEngineClient
from hotswap.engine.core_proc import run_engine_core
from hotswap.engine.dp_client import RankLauncher, rank_args
from hotswap.engine_args import EngineArgs
from hotswap.ray.ranks import GROUP_PREFIX

NAMESPACE = "hotswap"  # the ranks' actors are named hotswap-dp-rank-{rank}-{tag} in it
PLACEMENT_TIMEOUT_S = 120.0


class EngineCoreActor:
    """One engine core. Made a Ray actor with `ray.remote(EngineCoreActor).options(...)` at
    creation (by `RayRankLauncher`), so importing this module defines no remote class."""

    def __init__(self) -> None:
        # A terminal's Ctrl-C reaches Ray's worker processes too; the front-end owns our
        # shutdown (as core_proc's child process ignores it).
        with contextlib.suppress(ValueError):  # not on the main thread: nothing to do
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def run(
        self,
        input_addr: str,
        output_addr: str,
        engine_args_json: str,
        server_key: bytes | None = None,
    ) -> bool:
        """Serve the front-end's sockets until SHUTDOWN (or a failure of the loop, which
        this returns as True); raises if the core cannot start. `server_key`: the
        front-end's CURVE public key (None: plain TCP)."""
        return run_engine_core(input_addr, output_addr, engine_args_json, server_key)


class RayCoreRunner(CoreRunner):
    """An `EngineCoreActor` behind TCP sockets bound on this node's IP."""

    kind = "actor"

    def __init__(self, actor_class: ActorClass, options: dict[str, Any]) -> None:
        self.actor_class = actor_class
        self.options = options
        self.actor: ActorHandle | None = None
        self.run_ref: ray.ObjectRef | None = None
        self.server_key: bytes | None = None

    def bind(self, input: zmq.Socket, output: zmq.Socket) -> tuple[str, str]:
        host = ray.util.get_node_ip_address()  # never a wildcard: one interface only
        secret = None
        if zmq.has("curve"):  # pyzmq's wheels have it; a build without it: plain TCP
            self.server_key, secret = zmq.curve_keypair()
        for sock in (input, output):
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            if secret is not None:
                sock.curve_server = True
                sock.curve_secretkey = secret
        if ":" in host:
            host = f"[{host}]"
        base = f"tcp://{host}"
        input_port = input.bind_to_random_port(base)
        output_port = output.bind_to_random_port(base)
        return f"{base}:{input_port}", f"{base}:{output_port}"

    def start(self, input_addr: str, output_addr: str, engine_args: EngineArgs) -> None:
        self.actor = self.actor_class.options(**self.options).remote()
        args_json = json.dumps(dataclasses.asdict(engine_args))
        self.run_ref = self.actor.run.remote(input_addr, output_addr, args_json, self.server_key)

    def alive(self) -> bool:
        if self.run_ref is None:
            return False
        try:
            ready, _ = ray.wait([self.run_ref], timeout=0)
        except Exception:  # noqa: BLE001 - Ray itself is gone (shut down): so is the core
            return False
        return not ready

    def exit_description(self) -> str:
        if self.run_ref is None:
            return "was not started"
        try:
            failed = ray.get(self.run_ref, timeout=5)
        except Exception as e:  # noqa: BLE001 - the actor died or `run` raised: say why
            cause = getattr(e, "cause", None) or e  # what `run` raised, if it did
            lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
            return f"died: {(lines or [type(cause).__name__])[0][:300]}"
        return "ended after its loop failed" if failed else "ended"

    def stop(self, grace_s: float) -> None:
        if self.run_ref is not None:
            with contextlib.suppress(Exception):
                ray.wait([self.run_ref], timeout=grace_s)
        if self.actor is not None:
            with contextlib.suppress(Exception):  # already dead, or Ray shut down
                ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        pass  # the ports close with the sockets


def ray_rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """One rank's engine as a Ray actor: `rank_args`, except that its GPU is cuda:0 (Ray
    sets CUDA_VISIBLE_DEVICES to the one it gives the actor) and, on GPUs, one torch thread
    unless num_threads says otherwise (on CPUs the threads are this node's CPUs shared out,
    as with processes; pass --num-threads when the actors run on other nodes)."""
    one = rank_args(args, rank)
    if one.device.startswith("cuda"):
        return dataclasses.replace(one, device="cuda:0", num_threads=args.num_threads or 1)
    return one


def rank_resources(args: EngineArgs) -> dict[str, float]:
    """The bundle one tensor-parallel rank of a core (after `ray_rank_args`) reserves: its
    share of the core's CPU threads, its GPU."""
    threads = max(1, (args.num_threads or 1) // args.tensor_parallel_size)
    bundle = {"CPU": float(threads)}
    if args.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


class RayRankLauncher(RankLauncher):
    """Connects to Ray (or starts a local one), reserves one placement group per rank, and
    starts each rank's actor on bundle 0 of its group. `shutdown` removes the groups and
    shuts Ray down if this launcher initialized it."""

    def __init__(self, engine_args: EngineArgs) -> None:
        self.owns_ray = False
        self.placements: list[PlacementGroup] = []
        self.tag = uuid.uuid4().hex[:8]
        try:
            self.owns_ray = _init_ray(engine_args.ray_address)
            self.actor_class = ray.remote(EngineCoreActor)
            for rank in range(engine_args.data_parallel_size):
                self.placements.append(_reserve(engine_args, rank, self.tag))
        except BaseException:
            self.shutdown()
            raise

    def start_rank(self, engine_args: EngineArgs, rank: int) -> EngineCoreClient:
        args = ray_rank_args(engine_args, rank)
        resources = rank_resources(args)
        options = {
            "name": f"hotswap-dp-rank-{rank}-{self.tag}",
            "namespace": NAMESPACE,
            "num_cpus": resources["CPU"],  # its workers reserve the other bundles
            "num_gpus": resources.get("GPU", 0),
            "max_restarts": 0,  # a dead rank fails its requests; it does not come back
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placements[rank], placement_group_bundle_index=0
            ),
        }
        return MPEngineClient(args, runner=RayCoreRunner(self.actor_class, options))

    def shutdown(self) -> None:
        for group in self.placements:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self.placements = []
        if self.owns_ray:
            self.owns_ray = False
            ray.shutdown()


def _init_ray(address: str | None) -> bool:
    """Joins the cluster at `address` (None: `ray.init()`'s choice, a new local cluster if
    none is found) unless this process already has; returns whether it did."""
    if ray.is_initialized():
        return False
    ray.init(address=address)
    return True


def _reserve(engine_args: EngineArgs, rank: int, tag: str) -> PlacementGroup:
    """Rank `rank`'s group: one bundle per tensor-parallel rank, named as a tensor-parallel
    group (`ranks.GROUP_PREFIX`) so the core places its workers on it."""
    size = engine_args.tensor_parallel_size
    bundles = [rank_resources(ray_rank_args(engine_args, rank)) for _ in range(size)]
    group = placement_group(bundles, strategy="STRICT_PACK" if size > 1 else "PACK",
                            name=f"{GROUP_PREFIX}{tag}-{rank}")  # fmt: skip
    if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
        free = ray.available_resources()
        remove_placement_group(group)
        raise RuntimeError(
            f"data_parallel_backend ray: the cluster could not place engine core {rank} "
            f"({size} bundle(s) of {bundles[0]} on one node) within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s (free: {free})"
        )
    return group
