"""Worker side of a weight transfer: one `WeightTransferEngine` per engine core, chosen by
`WeightTransferConfig(backend=...)` through a registry. Everything else about the channel
(rendezvous, packing, buffer sizes) comes from the trainer in `init_info`, so the two
sides cannot disagree about it."""

from __future__ import annotations

import ipaddress
import json
import math
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from hotswap.weight_transfer.base import ParamMeta, metas_from_update_info

Allocator = Callable[[ParamMeta], torch.Tensor]


def parse_config_object(value: str | dict[str, Any]) -> dict[str, Any]:
    """`--weight-transfer-config` JSON text (or a dict) as a dict; ValueError otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"weight_transfer_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("weight_transfer_config: must be a JSON object")
    return value


@dataclass(frozen=True)
class WeightTransferConfig:
    backend: str = "gloo"
    # Refuse a round that does not write every weight of the model (off: partial updates,
    # e.g. only the trained layers, are allowed).
    require_complete: bool = False
    # A round with no call for this long (its trainer died or hangs between calls) is
    # aborted, and generation resumes. Idle time: a long receive does not count against it.
    round_timeout_s: float = 30.0
    # Master addresses a broadcast init may name (host names, addresses or networks such
    # as "10.0.0.0/8"); None: any. The engine connects to whatever a control caller names.
    allowed_master_addresses: tuple[str, ...] | None = None
    # Keep last round's receive buffers for the next (one extra copy of what was sent held
    # between rounds, on the engine's device; about 3x faster receives on CPU). Off:
    # allocate per round (on a GPU short of memory). Sleep (level >= 1) drops them.
    # The ipc backend stages views of the trainer's memory and uses no buffers.
    reuse_receive_buffers: bool = True

    def __post_init__(self) -> None:
        timeout = self.round_timeout_s
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not (timeout > 0 and math.isfinite(timeout))
        ):
            raise ValueError(f"round_timeout_s: must be a positive number, got {timeout!r}")
        allowed = self.allowed_master_addresses
        if allowed is not None:
            if isinstance(allowed, str) or not all(isinstance(a, str) and a for a in allowed):
                raise ValueError("allowed_master_addresses: must be a list of host names, "
                                 "addresses or networks")  # fmt: skip
            object.__setattr__(self, "allowed_master_addresses", tuple(allowed))

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | WeightTransferConfig | None
    ) -> WeightTransferConfig | None:
        """From `--weight-transfer-config` JSON, a dict, or an instance; None stays None."""
        if value is None or isinstance(value, WeightTransferConfig):
            return value
        value = parse_config_object(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"weight_transfer_config: unknown key(s) {unknown}")
        config = cls(**value)
        get_backend(config.backend)  # validates the name
        return config


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

    def check_master_address(self, address: str) -> None:
        """ValueError unless `address` is on the engine's allow-list (if it has one)."""
        allowed = self.allowed_master_addresses
        if allowed is not None and not address_allowed(address, allowed):
            raise ValueError(
                f"init_info.master_address: {address!r} is not an allowed master address "
                f"(allowed_master_addresses: {', '.join(allowed)})"
            )

    @abstractmethod
    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the channel (may block until the trainer joins too)."""

    def parse_update_info(self, update_info: dict[str, Any]) -> list[ParamMeta]:
        """The tensors an update will deliver; ValueError naming the bad field."""
        return metas_from_update_info(update_info)

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


_REGISTRY: dict[str, type[WeightTransferEngine]] = {}


def register_backend(name: str):  # noqa: ANN201 - a class decorator
    def register(cls: type[WeightTransferEngine]) -> type[WeightTransferEngine]:
        _REGISTRY[name] = cls
        return cls

    return register


def get_backend(name: str) -> type[WeightTransferEngine]:
    _load_builtin_backends()
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown {name!r}; choose from {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def create_transfer_engine(
    config: WeightTransferConfig, device: torch.device
) -> WeightTransferEngine:
    engine = get_backend(config.backend)(device)
    engine.allowed_master_addresses = config.allowed_master_addresses
    return engine


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


def _load_builtin_backends() -> None:
    # Imported for their @register_backend side effect.
    from hotswap.weight_transfer import broadcast, disk, ipc, sparse  # noqa: F401
