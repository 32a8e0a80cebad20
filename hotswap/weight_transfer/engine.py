"""Worker side of a weight transfer: one `WeightTransferEngine` per engine core, chosen by
`WeightTransferConfig(backend=...)` through a registry (`backends.get_backend`). Everything
else about the channel (rendezvous, packing, buffer sizes) comes from the trainer in
`init_info`, so the two sides cannot disagree about it."""

from __future__ import annotations

import ipaddress
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta, metas_of
from hotswap.weight_transfer.config import ENGINE_BACKENDS
from hotswap.weight_transfer.infos import Info, NoInitInfo, TensorsInfo, parse_info

Allocator = Callable[[ParamMeta], torch.Tensor]
# What `receive_weights` yields for a tensor every rank received its own part of, into its
# own stage (a backend where every rank receives: m2n.py): the commit writes the stages.
STAGED = "staged on every rank"


def shift_rank_offset(init_info: dict[str, Any], shift: int) -> dict[str, Any]:
    """The init info for a receiver `shift` workers further on: a broadcast init (it has a
    world size) moves its first worker rank (default 1: the trainer is rank 0); any other
    init info is the same for every receiver."""
    offset = init_info.get("rank_offset", 1)
    if "world_size" not in init_info or not isinstance(offset, int) or isinstance(offset, bool):
        return init_info
    return {**init_info, "rank_offset": offset + shift}


class WeightTransferEngine(ABC):
    """init once; per round: start, receive (one or more update infos), finish."""

    backend: ClassVar[str]
    needs_init: ClassVar[bool] = True  # False: usable without init_weight_transfer_engine
    # Whether every tensor-parallel rank receives its own part (m2n), each placing itself
    # in the group by its engine rank (data_parallel_rank x tp + its rank); else rank 0
    # receives for its core, and data-parallel core i is worker rank_offset + i.
    every_rank_receives: ClassVar[bool] = False
    sends_deltas: ClassVar[bool] = False  # True: yields `Delta`s (sparse.py), not tensors
    # The device type on which this backend meets a process group its trainer creates as
    # the RL frameworks' trainers do (SGLang's, AReaL's, TRL's, PipelineRL's: one broadcast
    # per tensor), the group's torch.distributed backend then bearing this backend's name.
    # None: it meets no such group.
    group_device: ClassVar[str | None] = None
    # What init_weight_transfer_engine and update_weights carry (infos.py): the engine
    # parses with them, and so does a front end that knows the backend (make_args).
    init_info_cls: ClassVar[type[Info]] = NoInitInfo
    update_info_cls: ClassVar[type[Info]] = TensorsInfo

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Where received tensors go; the engine installs a pool that reuses last round's
        # memory (fresh allocations cost page faults: ~3x slower than copying into warm
        # memory on this machine).
        self.allocate: Allocator = lambda meta: torch.empty(
            meta.shape, dtype=meta.dtype, device=device
        )
        # Set when the round is aborted while `init_transfer_engine` waits for the trainer.
        self.cancel = threading.Event()
        self.allowed_master_addresses: tuple[str, ...] | None = None
        # The only directories a backend that reads files (disk) reads, as real paths; the
        # engine sets its allowed_weight_dirs. None: anywhere (an engine used on its own).
        self.allowed_dirs: tuple[Path, ...] | None = None

    def attach(self, ranks: Any) -> None:  # noqa: B027 - optional hook
        """The engine core's tensor-parallel ranks (m2n.py's `RankTransfer`), given to
        every backend before its init; one where every rank receives uses them."""

    def check_master_address(self, address: str) -> None:
        """InvalidArgument unless `address` is on the engine's allow-list (if it has one)."""
        allowed = self.allowed_master_addresses
        if allowed is not None and not address_allowed(address, allowed):
            raise InvalidArgument(
                "init_info.master_address",
                f"init_info.master_address: {address!r} is not an allowed master address "
                f"(allowed_master_addresses: {', '.join(allowed)})",
            )

    @abstractmethod
    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the channel (may block until the trainer joins too)."""

    def parse_init_info(self, init_info: object) -> Info:
        """`init_info` as this backend's `init_info_cls`; InvalidArgument naming the path
        (`init_info.master_port`)."""
        return parse_info(self.init_info_cls, init_info, "init_info")

    def parse_update_info(self, update_info: dict[str, Any]) -> list[ParamMeta]:
        """The tensors an update will deliver; InvalidArgument naming the bad field (the
        path from `update_info`, e.g. `update_info.names[2]`)."""
        info = parse_info(self.update_info_cls, update_info, "update_info")
        assert isinstance(info, TensorsInfo)  # a backend with another kind parses its own
        return metas_of(info)

    def start_weight_update(self) -> None:  # noqa: B027 - optional hook
        """A round begins."""

    @abstractmethod
    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the update's tensors (owned by the caller). Must consume the whole payload
        even if the caller stops early, so the channel stays in step with the sender."""

    def finish_weight_update(self) -> None:  # noqa: B027 - optional hook
        """A round ended (committed or not)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Leave the channel."""

    def world_size(self) -> int:
        """Receiving workers behind this engine core."""
        return 1

    @classmethod
    def receivers(cls, tensor_parallel_size: int) -> int:
        """Receiving workers behind an engine core of `tensor_parallel_size` ranks, before
        any init (what a trainer sizes its group with): rank 0 alone, unless every rank
        receives itself."""
        return tensor_parallel_size if cls.every_rank_receives else 1


def register_backend(name: str):  # noqa: ANN201 - a class decorator
    """Class decorator: the engine class of backend `name`, in the registry
    (config.ENGINE_BACKENDS) that `backends.get_backend` and a config's check read."""

    def register(cls: type[WeightTransferEngine]) -> type[WeightTransferEngine]:
        ENGINE_BACKENDS[name] = cls
        return cls

    return register


def _resolve(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return {ipaddress.ip_address(host.split("%", 1)[0])}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos}


def address_allowed(address: str, allowed: tuple[str, ...]) -> bool:
    """Whether every address `address` resolves to is allowed: listed (by name or
    address) or inside a listed network."""
    if address in allowed:
        return True
    resolved = _resolve(address)
    if not resolved:
        return False
    permitted: set = set()
    networks = []
    for entry in allowed:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            permitted |= _resolve(entry)
    return all(ip in permitted or any(ip in net for net in networks) for ip in resolved)
