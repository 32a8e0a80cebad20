"""The built-in backends and the lookups by backend name, on both sides of a transfer.

Each backend registers itself when imported (`register_backend`, `register_trainer`). The
backends import `engine` and `trainer`, so the lookups, which must see every backend, live
here, above all of them."""

from __future__ import annotations

import torch

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer import (  # noqa: F401 - imported to register them
    broadcast,
    broadcast_trainer,
    disk,
    ipc,
    m2n,
    m2n_trainer,
    sparse,
)
from hotswap.weight_transfer.base import WeightSource
from hotswap.weight_transfer.clients import WeightSyncClient
from hotswap.weight_transfer.config import ENGINE_BACKENDS, WeightTransferConfig, check_backend_name
from hotswap.weight_transfer.engine import WeightTransferEngine
from hotswap.weight_transfer.infos import parse_info
from hotswap.weight_transfer.trainer import (
    TRAINER_BACKENDS,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    register_trainer,
)


def get_backend(name: str) -> type[WeightTransferEngine]:
    """The worker-side engine class registered under `name`; InvalidArgument if none is."""
    check_backend_name(name)
    return ENGINE_BACKENDS[name]


def group_backend(device: str) -> str:
    """The backend a trainer's process group must name for an engine on `device` to meet
    it (gloo on CPU, nccl on CUDA): the one that declares the device's type its
    `group_device`."""
    kind = torch.device(device).type
    return next(name for name, cls in ENGINE_BACKENDS.items() if cls.group_device == kind)


def check_info(backend: str, declared: object, value: object, field: str) -> None:
    """A verb argument declared as a transfer info (`Annotated[..., "init_info_cls"]`:
    verbs.py) checked as backend `backend`'s struct of that name; InvalidArgument names the
    path from `field`. Any other argument passes."""
    kinds = [m for m in getattr(declared, "__metadata__", ()) if isinstance(m, str)]
    if kinds:
        parse_info(getattr(get_backend(backend), kinds[0]), value, field)


def create_transfer_engine(
    config: WeightTransferConfig, device: torch.device
) -> WeightTransferEngine:
    engine = get_backend(config.backend)(device)
    engine.allowed_master_addresses = config.allowed_master_addresses
    return engine


class WeightTransferTrainerFactory:
    register = staticmethod(register_trainer)

    @classmethod
    def trainer_init(
        cls, init_info: TrainerInitInfo, client: WeightSyncClient, source: WeightSource
    ) -> TrainerWeightTransferEngine:
        engine_cls = TRAINER_BACKENDS.get(init_info.backend)
        if engine_cls is None:
            raise InvalidArgument(
                "init_info", f"init_info: no trainer engine for backend {init_info.backend!r}"
            )
        engine = engine_cls(init_info, client, source)
        if engine.is_sender:
            engine.connect()
        return engine
