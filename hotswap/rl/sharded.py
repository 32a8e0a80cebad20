"""Trainer-side resharding: every rank of a sharded trainer (FSDP2 / DTensor parameters,
a torch.distributed group on gloo or NCCL) pushes its own shards into a tensor-parallel
engine started with `--weight-transfer-config '{"backend": "m2n"}'`; each engine rank
receives only the parts of its slices (weight_transfer/m2n.py).

    sender = sharded_sender(model, HTTPWeightSyncClient(url), engine_ranks=2)  # every rank
    for step in range(steps):
        train_one_step(model)
        sender.send_weights(f"step-{step}")  # rank 0 gets the engine's commit
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from hotswap.weight_transfer.backends import WeightTransferTrainerFactory
from hotswap.weight_transfer.clients import WeightSyncClient
from hotswap.weight_transfer.infos import DEFAULT_TIMEOUT_S
from hotswap.weight_transfer.m2n_trainer import M2NTrainer, M2NTrainerInitInfo, ShardedSource


def sharded_sender(
    model: torch.nn.Module,
    client: WeightSyncClient | None,
    *,
    engine_ranks: int,
    master_address: str = "127.0.0.1",
    master_port: int | None = None,
    group: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> M2NTrainer:
    """Called by every trainer rank of `group` (None: the default group) with its part of
    `model`; joins the engine's `engine_ranks` tensor-parallel ranks (the engine's
    /get_world_size) and declares every rank's shards. `client` is used on rank 0 only;
    `master_port` (None: a free one, picked by rank 0 on `master_address`) hosts the
    transfer group. The source reads the shards live: each round sends their current
    values."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    port = [master_port if master_port is not None else _free_port(master_address)]
    if master_port is None and ranks > 1:
        dist.broadcast_object_list(port, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)  # fmt: skip
    info = M2NTrainerInitInfo(rank=rank, master_address=master_address, master_port=port[0],
                              world_size=ranks + engine_ranks, num_trainer_ranks=ranks,
                              trainer_group=group, timeout_s=timeout_s)  # fmt: skip
    source = ShardedSource.from_module(model)
    sender = WeightTransferTrainerFactory.trainer_init(info, client if rank == 0 else None, source)
    assert isinstance(sender, M2NTrainer)
    return sender


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
