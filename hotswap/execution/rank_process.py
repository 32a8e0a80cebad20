"""A tensor-parallel worker: rank 1.. of one engine core's group, in its own process.

Started by rank 0 (execution/ranks.py) as `python -m hotswap.execution.rank_process HOST PORT
RANK SIZE`, or as a Ray actor calling `run_rank` (hotswap/ray/ranks.py); reads the
engine config from rank 0's store, builds its share of the model, then runs every call
rank 0 sends, in order, until told to stop or the group fails (rank 0's process ended: its
sockets close, and the worker exits with it). A second thread runs the weight transfers
this rank receives itself (weight_transfer/m2n.py), so a round is received while steps
run; its stage is written into the model by a call on the first. In the engine layer: it
runs the model and the weight-transfer backends."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading

import torch
import torch.distributed as dist

from hotswap.engine.rpc import RPC_CALL, make_extension, run_everywhere
from hotswap.execution.ranks import STOP, connect_channels
from hotswap.execution.runner import ModelRunner
from hotswap.model.parallel import GROUP_TIMEOUT, TensorParallelError, TPGroup
from hotswap.weight_transfer.m2n import M2NRank, worker_call
from hotswap.weights.double_buffer import DROP_RECEIVED, SHADOW_WRITE

logger = logging.getLogger(__name__)


def serve(host: str, port: int, rank: int, size: int) -> int:
    store = dist.TCPStore(host, port, size, is_master=False, timeout=GROUP_TIMEOUT)
    # The launcher chose this rank's device (`cuda:0` in a Ray actor given one GPU).
    device = store.get(f"device{rank}").decode()
    config = dataclasses.replace(pickle.loads(store.get("config")), device=device)
    torch.set_num_threads(int(store.get("threads")))
    store.set(f"joining{rank}", b"1")
    groups = connect_channels(store, rank, size, config.device)
    runner, extension, error = None, None, None
    try:
        runner = ModelRunner(config, progress=False, groups=groups)
        if config.worker_extension_cls is not None:  # this rank's own, over its share
            extension = make_extension(config, runner)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        error = f"{type(e).__name__}: {e}"
    groups[0].gather_objects(error)
    if runner is None or error is not None:
        return 1
    threading.Thread(target=_transfers, args=(runner, groups[1]), daemon=True,
                     name="hotswap-tp-transfers").start()  # fmt: skip
    while True:
        name, args = groups[0].broadcast_object()
        if name == STOP:
            return 0
        if name == RPC_CALL:  # answered with every rank's result (rank 0 raises errors)
            run_everywhere(groups[0], lambda: extension.call(*args))  # noqa: B023
        else:
            getattr(runner, name)(*args)


def _transfers(runner: ModelRunner, channel: TPGroup) -> None:
    """The transfer calls rank 0 sends, each answered with this rank's error (or None)."""
    rank: M2NRank | None = None
    try:
        while True:
            call = channel.broadcast_object()
            if call[0] == STOP:
                return
            error = None
            try:
                if call[0] == SHADOW_WRITE:  # the double buffer (weights/double_buffer.py)
                    runner.receive_shadow_writes(*call[1])
                elif call[0] == DROP_RECEIVED:
                    runner.forget_received()
                else:
                    rank = worker_call(rank, runner, runner.device, call)
            except Exception as e:  # noqa: BLE001 - rank 0 raises it for the round
                error = f"{type(e).__name__}: {e}"
            channel.gather_objects(error)
    except TensorParallelError as e:
        logger.warning("tensor-parallel transfers end: %s", e)


def run_rank(host: str, port: int, rank: int, size: int) -> int:
    """`serve`, ending quietly (code 2) when the group fails: rank 0 has gone."""
    try:
        return serve(host, port, rank, size)
    except TensorParallelError as e:
        logger.warning("tensor-parallel rank %d ends: %s", rank, e)
        return 2


def main() -> int:
    host, port, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    return run_rank(host, port, rank, size)


if __name__ == "__main__":
    code = main()
    # Exit without finalising: gloo groups destroyed during interpreter shutdown (the
    # transfer thread's may still be in a receive) abort the process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
