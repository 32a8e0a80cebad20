"""Rank 0's side of tensor parallelism: starting the other ranks as worker processes,
and sending them every call that must run on all ranks.

Invariant: only rank 0's engine-core thread sends on the group, and every rank runs the
calls it sends in the order sent, so the ranks' collectives always pair up. A call is
`(runner method name, args)`; the workers run it on their own runner. A worker's process
entry point is `hotswap.execution.rank_process`, named here only as a module to run (it runs
the weight-transfer backends too, a layer above the model).
"""

from __future__ import annotations

import functools
import importlib
import logging
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from hotswap.config import EngineConfig
from hotswap.model.parallel import GROUP_TIMEOUT, TPGroup

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP = "stop"  # the call that ends a worker's loop
F = TypeVar("F", bound=Callable[..., Any])


def connect_channels(
    store: dist.Store, rank: int, size: int, device: str
) -> tuple[TPGroup, TPGroup]:
    """The ranks' two groups: steps and every-rank calls; weight transfers every rank
    receives (their own thread, so a round is received while steps run)."""
    place = torch.device(device)
    if place.type == "cuda":  # NCCL binds each rank to its current device
        torch.cuda.set_device(place)
    steps = TPGroup.connect(dist.PrefixStore("steps/", store), rank, size, place)
    transfers = TPGroup.connect(dist.PrefixStore("transfers/", store), rank, size, place)
    return steps, transfers


def on_every_rank(method: F) -> F:
    """A runner method that, called on rank 0 with tensor parallelism, first sends the
    call to every other rank (which run the same method with the same arguments)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any) -> Any:
        if self.tp.parallel and self.tp.rank == 0:
            self.tp.broadcast_object((method.__name__, args))
        return method(self, *args)

    return call  # type: ignore[return-value]


class WorkerHandle(Protocol):
    """One worker rank as rank 0 sees it, wherever it runs (a process, a Ray actor)."""

    def exit_code(self) -> int | None:  # None while it runs
        ...

    def wait(self, timeout_s: float) -> bool:  # whether it exited within the time
        ...

    def kill(self) -> None: ...


# Starts ranks 1..size-1 joining rank 0's store at HOST:port; sets each rank's device
# (`device{rank}` in the store) first. The Ray one is named as "module:function" (the core
# never imports Ray).
Launcher = Callable[[dist.Store, int, int, EngineConfig], list[WorkerHandle]]
LAUNCHERS: dict[str, str] = {
    "mp": "hotswap.execution.ranks:start_processes",
    "ray": "hotswap.ray.ranks:start_actors",
}


class TensorParallelWorkers:
    """Ranks 1..N-1 of one engine core's tensor-parallel group (started by the config's
    `distributed_executor_backend`), and the group itself (`group`, rank 0 of it)."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.store = dist.TCPStore(HOST, 0, size, is_master=True, timeout=GROUP_TIMEOUT,
                                   wait_for_workers=False)  # fmt: skip
        self.store.set("config", pickle.dumps(config))
        # The engine core's threads, shared evenly by its ranks (they run at the same time).
        threads = max(1, torch.get_num_threads() // size)
        self.store.set("threads", str(threads))
        launch = _launcher(config.distributed_executor_backend)
        self.workers = launch(self.store, self.store.port, size, config)
        # The workers outlive nothing: killed with this object or at exit at the latest.
        self._finalizer = weakref.finalize(self, _kill, list(self.workers))
        self._wait_for("joining", size)
        torch.set_num_threads(threads)
        self.group, self.transfer_channel = connect_channels(self.store, 0, size, config.device)

    def _wait_for(self, key: str, size: int) -> None:
        """Until every worker has set `key{rank}`; a worker that exits first fails it."""
        keys = [f"{key}{rank}" for rank in range(1, size)]
        deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            for rank, worker in enumerate(self.workers, start=1):
                code = worker.exit_code()
                if code is not None:
                    self.kill()
                    raise RuntimeError(
                        f"tensor parallelism: worker rank {rank} exited with code {code} "
                        "while starting"
                    )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("tensor parallelism: the workers did not start in time")
            time.sleep(0.05)

    def confirm_started(self) -> None:
        """After rank 0 built its runner: every rank's start-up error (None: started),
        gathered; the first raises here after the workers are stopped."""
        for rank, error in enumerate(self.group.gather_objects(None)):
            if error is not None:
                self.kill()
                raise RuntimeError(f"tensor parallelism: rank {rank} failed to start: {error}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the workers' loops and waits for them (kills those that do not exit)."""
        if self.group.failed is None and any(w.exit_code() is None for w in self.workers):
            try:
                self.transfer_channel.broadcast_object((STOP, ()))
                self.group.broadcast_object((STOP, ()))
            except RuntimeError:
                logger.warning("tensor parallelism: could not tell the workers to stop")
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            if not worker.wait(max(0.1, deadline - time.monotonic())):
                worker.kill()
        _kill(self.workers)  # a Ray actor outlives its loop until killed
        self._finalizer.detach()

    def kill(self) -> None:
        _kill(self.workers)


def _launcher(name: str) -> Launcher:
    module, _, function = LAUNCHERS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _kill(workers: list[WorkerHandle]) -> None:
    for worker in workers:
        worker.kill()


class WorkerProcess:
    """A worker rank as a child process: `python -m hotswap.execution.rank_process`."""

    def __init__(self, port: int, rank: int, size: int) -> None:
        command = [sys.executable, "-m", "hotswap.execution.rank_process", HOST, str(port),
                   str(rank), str(size)]  # fmt: skip
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device when the ranks share a machine's GPUs: the next indices after
    rank 0's (`cuda:2` -> rank 1 on `cuda:3`); the CPU for every rank on a CPU."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{int(device.partition(':')[2] or 0) + rank}"


def start_processes(
    store: dist.Store, port: int, size: int, config: EngineConfig
) -> list[WorkerHandle]:
    """The "mp" launcher: ranks 1.. as child processes of the engine core."""
    for rank in range(1, size):
        store.set(f"device{rank}", rank_device(config.device, rank))
    return [WorkerProcess(port, rank, size) for rank in range(1, size)]
