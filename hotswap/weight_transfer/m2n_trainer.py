"""Trainer side of the m2n backend: every trainer rank sends each engine rank the parts of
its own shards that engine rank holds (m2n_plan.py), so no rank gathers a whole tensor.

Each trainer rank builds `M2NTrainer` over its `ShardedSource` (its local shards and where
they lie); the ranks' declarations are exchanged over the trainer's own process group,
rank 0 declares them all to the engine (init_weight_transfer_engine) and drives each
round's calls, and every rank moves its own pieces."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from hotswap.model.parallel import TPGroup
from hotswap.weight_transfer.base import ParamMeta, WeightSource
from hotswap.weight_transfer.clients import Committed, WeightSyncClient
from hotswap.weight_transfer.dtypes import dtype_name
from hotswap.weight_transfer.infos import DEFAULT_TIMEOUT_S, parse_info
from hotswap.weight_transfer.m2n import exchange_layouts
from hotswap.weight_transfer.m2n_plan import M2NInitInfo, box, plan, relative
from hotswap.weight_transfer.rendezvous import join_group
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    register_trainer,
    run_alongside,
)


@dataclass(kw_only=True)
class M2NTrainerInitInfo(TrainerInitInfo):
    """`rank`: this trainer rank (of `num_trainer_ranks`); `world_size`: the trainer ranks
    plus every engine rank (an engine with tensor_parallel_size N has N)."""

    backend: ClassVar[str] = "m2n"
    master_address: str = "127.0.0.1"
    master_port: int
    world_size: int
    num_trainer_ranks: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: str = "cpu"
    # The trainer ranks' own group, over which they exchange their shards' places (a
    # torch ProcessGroup; None: the default group, as an FSDP trainer has).
    trainer_group: Any = None


@dataclass(frozen=True)
class Shard:
    """This trainer rank's part of tensor `name` (of `shape`): `tensor`, entries from
    `offset` along `dim`; `dim` None: the whole tensor (held whole by rank 0 only)."""

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    dim: int | None = None
    offset: int = 0


class ShardedSource(WeightSource):
    """One trainer rank's shards, in a stable order (the same names on every rank)."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = shards

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ShardedSource:
        """A module's parameters and buffers under their names: DTensors sharded on one
        dimension of a one-dimensional mesh (FSDP2's layout) as their local shards,
        replicated and plain tensors whole."""
        return cls([_shard(name, t) for name, t in module.state_dict().items()])

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(s.name, s.tensor.dtype, s.shape) for s in self.shards]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((s.name, s.tensor) for s in self.shards)


def _shard(name: str, tensor: torch.Tensor) -> Shard:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as Sharded
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return Shard(name, tensor.detach(), tuple(tensor.shape))
    local = tensor.to_local().detach()
    shape = tuple(tensor.shape)
    placements = tensor.placements
    if tensor.device_mesh.ndim != 1 or not isinstance(placements[0], Sharded):
        return Shard(name, tensor.full_tensor().detach(), shape)  # replicated: whole
    dim = placements[0].dim
    _, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, placements)
    return Shard(name, local, shape, dim, int(offset[dim]))


@register_trainer("m2n")
class M2NTrainer(TrainerWeightTransferEngine):
    info: M2NTrainerInitInfo
    source: ShardedSource

    def __init__(
        self, info: M2NTrainerInitInfo, client: WeightSyncClient | None, source: ShardedSource
    ) -> None:
        super().__init__(info, client, source)  # type: ignore[arg-type]
        self.bytes_sent = 0

    @property
    def is_sender(self) -> bool:
        return True  # every trainer rank sends its own pieces

    def connect(self) -> None:
        info = self.info
        self.wire = self._declaration()
        # checked as the engine will check it, before anything is sent
        self.plan_info = parse_info(M2NInitInfo, self.wire, "init_info")
        device = torch.device(info.device)

        def join() -> dist.ProcessGroup:
            group = join_group(info.master_address, info.master_port, info.rank,
                               info.world_size, device, info.timeout_s)  # fmt: skip
            self.layouts = exchange_layouts(group, self.plan_info, None)
            return group

        if info.rank == 0:
            assert self.client is not None
            init = self.client.init_weight_transfer_engine
            self.group = run_alongside(lambda: init(self.wire), join)
        else:
            self.group = join()

    def _declaration(self) -> dict[str, Any]:
        """The init info: every trainer rank's shards, exchanged over the trainer's group."""
        info, own = self.info, [(s.dim, s.offset, s.tensor.shape) for s in self.source.shards]
        every: list[Any] = [own]
        if info.num_trainer_ranks > 1 and info.trainer_group is not None:
            every = TPGroup(info.rank, info.num_trainer_ranks, info.trainer_group).gather_objects(
                own
            )
        elif info.num_trainer_ranks > 1:
            every = [None] * info.num_trainer_ranks
            dist.all_gather_object(every, own)
        shards: list[Any] = []
        for i, shard in enumerate(self.source.shards):
            parts = [(rank, ranks[i]) for rank, ranks in enumerate(every)]
            if shard.dim is None:
                shards.append(None)
            else:
                shards.append([{"rank": r, "dim": d, "offset": o, "length": size[d]}
                               for r, (d, o, size) in parts])  # fmt: skip
        return {
            "master_address": info.master_address, "master_port": info.master_port,
            "world_size": info.world_size, "rank_offset": info.num_trainer_ranks,
            "names": [s.name for s in self.source.shards],
            "dtype_names": [dtype_name(s.tensor.dtype) for s in self.source.shards],
            "shapes": [list(s.shape) for s in self.source.shards], "src_shards": shards,
            "timeout_s": info.timeout_s,
        }  # fmt: skip

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError("m2n rounds are sent by send_weights")

    def send_weights(
        self, weight_version: str | None = None, *, digest: bool = False,
        kv_policy: str | None = None, **_: Any,
    ) -> Committed | None:  # fmt: skip
        """One round of every declared tensor; rank 0 returns the engine's commit."""
        names = [s.name for s in self.source.shards]
        if self.info.rank != 0:
            self._send_pieces(names)
            return None
        assert self.client is not None
        update = self.client.update_weights
        return self.run_round(lambda: run_alongside(lambda: update({"names": names}),
                                                    lambda: self._send_pieces(names)),
                              weight_version, digest, kv_policy)  # fmt: skip

    def _send_pieces(self, names: list[str]) -> None:
        """Each piece this rank holds, to its engine rank; a tensor's sends are waited for
        before the next tensor's but one (bounded memory, the sends overlapping)."""
        by_index: dict[int, list[tuple[dist.Work, torch.Tensor]]] = {}
        info, rank = self.plan_info, self.info.rank
        for piece in plan(info, names, self.layouts):
            if piece.src != rank:
                continue
            shard = self.source.shards[piece.index]
            held = box(shard.shape, None if shard.dim is None
                       else (shard.dim, shard.offset, shard.tensor.shape[shard.dim]))  # fmt: skip
            data = shard.tensor[relative(piece.region, held)].contiguous()
            dst = info.rank_offset + piece.dst
            work = self.group.send([data], dst, piece.index)
            by_index.setdefault(piece.index, []).append((work, data))
            self.bytes_sent += data.numel() * data.element_size()
            for done in [i for i in by_index if i < piece.index - 1]:
                for work, _ in by_index.pop(done):
                    work.wait()
        for works in by_index.values():
            for work, _ in works:
                work.wait()

    def shutdown(self) -> None:
        self.group = None  # type: ignore[assignment]
