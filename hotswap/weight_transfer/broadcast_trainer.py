"""Trainer side of the broadcast backends (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hotswap.weight_transfer.base import ParamMeta, metas_to_update_info
from hotswap.weight_transfer.broadcast import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    BroadcastChannel,
    join_group,
)
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    register_trainer,
    run_alongside,
)


@dataclass(kw_only=True)
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int
    world_size: int  # this trainer process + every receiving engine worker
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: str = "cpu"


@dataclass(kw_only=True)
class NCCLTrainerInitInfo(GlooTrainerInitInfo):
    backend: ClassVar[str] = "nccl"
    device: str = "cuda"


@register_trainer("gloo")
@register_trainer("nccl")
class BroadcastTrainer(TrainerWeightTransferEngine):
    info: GlooTrainerInitInfo

    def connect(self) -> None:
        info = self.info
        worker_info = {
            "master_address": info.master_address,
            "master_port": info.master_port,
            "rank_offset": 1,
            "world_size": info.world_size,
            "packed": info.packed,
            "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
            "packed_num_buffers": info.packed_num_buffers,
            "timeout_s": info.timeout_s,
        }
        device = torch.device(info.device)
        group = run_alongside(
            lambda: self.client.init_weight_transfer_engine(worker_info),
            lambda: join_group(
                info.master_address, info.master_port, 0, info.world_size, device, info.timeout_s
            ),
        )
        self.channel = BroadcastChannel(
            group, device, info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers
        )

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        update_info = metas_to_update_info(metas)
        run_alongside(
            lambda: self.client.update_weights(update_info),
            lambda: self.channel.send(tensors),
        )
