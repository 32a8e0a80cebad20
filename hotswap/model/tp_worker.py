"""A tensor-parallel worker: rank 1.. of one engine core's group, in its own process.

Started by rank 0 (tp_workers.py) as `python -m hotswap.model.tp_worker HOST PORT RANK
SIZE`; reads the engine config from rank 0's store, builds its share of the model, then
runs every call rank 0 sends, in order, until told to stop or the group fails (rank 0's
process ended: its sockets close, and the worker exits with it)."""

from __future__ import annotations

import logging
import pickle
import sys

import torch
import torch.distributed as dist

from hotswap.model.parallel import GROUP_TIMEOUT, TensorParallelError, TPGroup
from hotswap.model.runner import ModelRunner
from hotswap.model.tp_workers import STOP

logger = logging.getLogger(__name__)


def serve(host: str, port: int, rank: int, size: int) -> int:
    store = dist.TCPStore(host, port, size, is_master=False, timeout=GROUP_TIMEOUT)
    config = pickle.loads(store.get("config"))
    torch.set_num_threads(int(store.get("threads")))
    store.set(f"joining{rank}", b"1")
    tp = TPGroup.connect(store, rank, size, torch.device(config.device))
    try:
        runner, error = ModelRunner(config, progress=False, tp=tp), None
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        runner, error = None, f"{type(e).__name__}: {e}"
    tp.gather_objects(error)
    if runner is None:
        return 1
    while True:
        name, args = tp.broadcast_object()
        if name == STOP:
            return 0
        getattr(runner, name)(*args)


def main() -> int:
    host, port, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    try:
        return serve(host, port, rank, size)
    except TensorParallelError as e:
        logger.warning("tensor-parallel rank %d ends: %s", rank, e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
