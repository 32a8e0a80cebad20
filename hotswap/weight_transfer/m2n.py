"""The m2n backend: resharded weight sync from M trainer ranks into N tensor-parallel engine
ranks over one torch.distributed group (gloo on CPU, NCCL on CUDA; point-to-point sends).
The plan (m2n_plan.py) gives each engine rank exactly its slices' bytes.

Every engine rank joins the group and receives its own pieces: rank 0 in the engine core
(`M2NEngine`, the registered backend), ranks 1.. in their worker processes' transfer
threads, told what to do over the tensor-parallel transfer channel (`RankTransfer`).
Pieces land in each rank's stage; the commit (finish_weight_update) writes every rank's
stage into its model between two steps, and an abort drops them all."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.dtypes import parse_dtype_name
from hotswap.weight_transfer.engine import STAGED, WeightTransferEngine, register_backend
from hotswap.weight_transfer.infos import Info, parse_info
from hotswap.weight_transfer.m2n_plan import (
    M2NInitInfo,
    M2NUpdateInfo,
    box,
    plan,
    region_shape,
    relative,
)
from hotswap.weight_transfer.rendezvous import join_group

Part = tuple[int, int, int] | None  # (dim, start, size) of a tensor; None: all of it


def exchange_layouts(
    group: dist.ProcessGroup, info: M2NInitInfo, own: list[Part] | None
) -> list[list[Part]]:
    """Every engine rank's parts, learnt by every member: engine rank e broadcasts its
    own (`own`; None on trainer ranks) as a [tensors, 3] table, -1 for a whole tensor."""
    layouts = []
    own_rank = group.rank()
    for rank in range(info.rank_offset, info.world_size):
        table = torch.full((len(info.names), 3), -1, dtype=torch.int64)
        if rank == own_rank:
            assert own is not None
            for i, part in enumerate(own):
                if part is not None:
                    table[i] = torch.tensor(part)
        group.broadcast(table, rank).wait()
        layouts.append([None if row[0] < 0 else tuple(row) for row in table.tolist()])
    return layouts


class M2NRank:
    """One engine rank's end of the group: joins, publishes its parts, receives its
    pieces of a round into `stage` (name -> this rank's part of the tensor)."""

    def __init__(self, device: torch.device, engine_rank: int, stage: dict[str, torch.Tensor]):
        self.device, self.engine_rank, self.stage = device, engine_rank, stage
        self.group: dist.ProcessGroup | None = None

    def join(self, info: M2NInitInfo, own: list[Part], cancel: threading.Event | None) -> None:
        self.info = info
        self.group = join_group(info.master_address, info.master_port,
                                info.rank_offset + self.engine_rank, info.world_size,
                                self.device, info.timeout_s, cancel)  # fmt: skip
        self.layouts = exchange_layouts(self.group, info, own)
        self.bytes_received = 0

    def receive(self, names: list[str]) -> None:
        assert self.group is not None
        info, own = self.info, self.layouts[self.engine_rank]
        for piece in plan(info, names, self.layouts):
            if piece.dst != self.engine_rank:
                continue
            name, shape = info.names[piece.index], info.shapes[piece.index]
            dtype = parse_dtype_name(info.dtype_names[piece.index])
            mine = box(shape, own[piece.index])
            if name not in self.stage:
                self.stage[name] = torch.empty(region_shape(mine), dtype=dtype, device=self.device)
            buffer = torch.empty(region_shape(piece.region), dtype=dtype, device=self.device)
            self.group.recv([buffer], piece.src, piece.index).wait()  # trainer ranks 0..M-1
            self.stage[name][relative(piece.region, mine)] = buffer
            self.bytes_received += buffer.numel() * buffer.element_size()

    def close(self) -> None:
        self.group = None


class RankTransfer(Protocol):
    """What the engine core's runner gives the m2n backend: its tensor-parallel rank,
    the transfer channel to the other ranks (`tell_workers` then `gather` their errors),
    each checkpoint tensor's full shape and this rank's part, and its stage."""

    engine_rank: int
    tp_size: int
    rank_stage: dict[str, torch.Tensor]

    def checkpoint_part(self, name: str) -> tuple[tuple[int, ...], Part] | None:
        """(the whole tensor's shape, this rank's part); None: a tensor the model ignores;
        ValueError: one it does not have."""

    def tell_workers(self, call: tuple[str, tuple]) -> None: ...
    def gather_errors(self, error: str | None) -> list[str | None]: ...


def worker_call(
    rank: M2NRank | None, ranks: RankTransfer, device: torch.device, call: tuple[str, tuple]
) -> M2NRank | None:
    """A transfer call on a rank other than 0 (its transfer thread); the rank's end after it."""
    name, args = call
    if name == "m2n_join":
        info = parse_info(M2NInitInfo, args[0], "init_info")
        joined = M2NRank(device, ranks.engine_rank, ranks.rank_stage)
        joined.join(info, checked_parts(ranks, info), None)
        return joined
    if name == "m2n_receive":
        assert rank is not None, "m2n: no group joined"
        rank.receive(args[0])
        return rank
    if rank is not None:  # m2n_leave
        rank.close()
    return None


def checked_parts(ranks: RankTransfer, info: M2NInitInfo) -> list[Part]:
    """This rank's part of each declared tensor ((0, 0, 0): none, for one the model
    ignores); refuses a tensor the model does not have, or in another shape."""
    parts: list[Part] = []
    for i, name in enumerate(info.names):
        try:
            found = ranks.checkpoint_part(name)
        except ValueError as e:
            raise InvalidArgument(f"init_info.names[{i}]",
                                  f"init_info.names[{i}]: {e}") from None  # fmt: skip
        if found is None:
            parts.append((0, 0, 0))  # a tensor the model ignores: no piece for it
            continue
        shape, part = found
        if tuple(info.shapes[i]) != tuple(shape):
            raise InvalidArgument(f"init_info.shapes[{i}]", f"init_info.shapes[{i}]: "
                                  f"{info.shapes[i]} for {name!r}; the model's is "
                                  f"{list(shape)}")  # fmt: skip
        parts.append(part)
    return parts


@register_backend("m2n")
class M2NEngine(WeightTransferEngine):
    """Rank 0's end (the backend an engine core configures); see the module docstring."""

    backend: ClassVar[str] = "m2n"
    # rank_offset is the number of trainer ranks: every engine rank, of every core, is
    # placed after them by its own engine_rank (RankTransfer)
    every_rank_receives: ClassVar[bool] = True
    init_info_cls: ClassVar[type[Info]] = M2NInitInfo
    update_info_cls: ClassVar[type[Info]] = M2NUpdateInfo

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.ranks: RankTransfer | None = None  # attached by the engine (WeightSync)
        self.rank: M2NRank | None = None

    def attach(self, ranks: RankTransfer) -> None:
        """Every rank receives: rank 0 tells the others what to do through `ranks`."""
        self.ranks = ranks

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = self.parse_init_info(init_info)
        assert isinstance(info, M2NInitInfo) and self.ranks is not None
        self.check_master_address(info.master_address)
        own = checked_parts(self.ranks, info)
        self.shutdown()
        self.ranks.tell_workers(("m2n_join", (init_info,)))
        rank = M2NRank(self.device, self.ranks.engine_rank, self.ranks.rank_stage)
        self._together(lambda: rank.join(info, own, self.cancel))
        self.rank = rank

    def _together(self, own: Callable[[], None]) -> None:
        """Run this rank's part of a transfer call, then every rank's errors: the first
        raises (rank 0's own as it was raised)."""
        assert self.ranks is not None
        error: Exception | None = None
        try:
            own()
        except Exception as e:  # noqa: BLE001 - reported after the other ranks answer
            error = e
        errors = self.ranks.gather_errors(None if error is None else str(error))
        if error is not None:
            raise error
        for rank, message in enumerate(errors):
            if message is not None:
                raise RuntimeError(f"m2n: tensor-parallel rank {rank} failed: {message}")

    def parse_update_info(self, update_info: dict[str, Any]) -> list[ParamMeta]:
        info = parse_info(M2NUpdateInfo, update_info, "update_info")
        assert isinstance(info, M2NUpdateInfo)
        if self.rank is None:
            raise RuntimeError("m2n: no group: call init_weight_transfer_engine first")
        declared = {name: i for i, name in enumerate(self.rank.info.names)}
        metas = []
        for j, name in enumerate(info.names):
            if name not in declared:
                raise InvalidArgument(f"update_info.names[{j}]", f"update_info.names[{j}]: "
                                      f"{name!r} was not declared at init")  # fmt: skip
            i = declared[name]
            metas.append(ParamMeta(name, parse_dtype_name(self.rank.info.dtype_names[i]),
                                   tuple(self.rank.info.shapes[i])))  # fmt: skip
        return metas

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, Any]]:
        assert self.ranks is not None and self.rank is not None
        names = [meta.name for meta in metas]
        self.ranks.tell_workers(("m2n_receive", (names,)))
        self._together(lambda: self.rank.receive(names))  # type: ignore[union-attr]
        for name in names:
            yield name, STAGED

    def shutdown(self) -> None:
        if self.rank is not None and self.ranks is not None:
            self.ranks.tell_workers(("m2n_leave", ()))
            self._together(self.rank.close)
        self.rank = None

    def world_size(self) -> int:
        """Every tensor-parallel rank of this engine core receives."""
        return self.ranks.tp_size if self.ranks is not None else 1
