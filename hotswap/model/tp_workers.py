"""Rank 0's side of tensor parallelism: starting the other ranks as worker processes,
and sending them every call that must run on all ranks.

Invariant: only rank 0's engine-core thread sends on the group, and every rank runs the
calls it sends in the order sent, so the ranks' collectives always pair up. A call is
`(runner method name, args)`; the workers run it on their own runner. A worker's process
entry point is `hotswap.engine.tp_worker`, named here only as a module to run (it runs
the weight-transfer backends too, a layer above the model).
"""

from __future__ import annotations

import functools
import logging
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

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


class TensorParallelWorkers:
    """Ranks 1..N-1 of one engine core's tensor-parallel group, as child processes, and
    the group itself (`group`, rank 0 of it)."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.store = dist.TCPStore(HOST, 0, size, is_master=True, timeout=GROUP_TIMEOUT,
                                   wait_for_workers=False)  # fmt: skip
        self.store.set("config", pickle.dumps(config))
        # The engine core's threads, shared evenly by its ranks (they run at the same time).
        threads = max(1, torch.get_num_threads() // size)
        self.store.set("threads", str(threads))
        self.procs = [self._spawn(rank, size) for rank in range(1, size)]
        # The workers outlive nothing: killed with this object or at exit at the latest.
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        self._wait_for("joining", size)
        torch.set_num_threads(threads)
        self.group, self.transfer_channel = connect_channels(self.store, 0, size, config.device)

    def _spawn(self, rank: int, size: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "hotswap.engine.tp_worker", HOST,
                   str(self.store.port), str(rank), str(size)]  # fmt: skip
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def _wait_for(self, key: str, size: int) -> None:
        """Until every worker has set `key{rank}`; a worker that exits first fails it."""
        keys = [f"{key}{rank}" for rank in range(1, size)]
        deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(
                        f"tensor parallelism: worker rank {rank} exited with code "
                        f"{proc.returncode} while starting"
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
        if self.group.failed is None and any(p.poll() is None for p in self.procs):
            try:
                self.transfer_channel.broadcast_object((STOP, ()))
                self.group.broadcast_object((STOP, ()))
            except RuntimeError:
                logger.warning("tensor parallelism: could not tell the workers to stop")
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self._finalizer.detach()

    def kill(self) -> None:
        _kill(self.procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
