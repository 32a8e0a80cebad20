"""`ipc`: a trainer on the same machine hands over weights through named shared memory.
The update info is JSON (names, dtype_names, shapes and the segment's name): no pickle
crosses the control plane. Packed mode bounds memory by splitting a round into segments of
at most `packed_buffer_size_bytes` (a larger tensor gets a segment of its own).

CUDA IPC (GPU trainer and engine sharing a device) is not implemented yet: this backend
moves host memory and refuses CUDA tensors with a clear error."""

from __future__ import annotations

import contextlib
import re
import secrets
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, ClassVar

import torch

from hotswap.weight_transfer.base import ParamMeta, metas_to_update_info
from hotswap.weight_transfer.engine import WeightTransferEngine, register_backend
from hotswap.weight_transfer.packing import arena_meta, layout, pack, views
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


@register_backend("ipc")
class IPCEngine(WeightTransferEngine):
    backend: ClassVar[str] = "ipc"
    needs_init: ClassVar[bool] = False

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if self.device.type != "cpu":
            raise ValueError("ipc: CUDA IPC is not implemented yet; use the nccl backend")

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        name = update_info.get("shm_name")
        if not isinstance(name, str) or not _SEGMENT_NAME.match(name):
            raise ValueError(f"update_info.shm_name: not a shared-memory segment name: {name!r}")
        total = layout(metas)[1]
        try:
            segment = _attach(name)
        except FileNotFoundError:
            raise ValueError(f"update_info.shm_name: no shared-memory segment {name!r}") from None
        try:
            if segment.size < total:
                raise ValueError(
                    f"update_info.shm_name: segment holds {segment.size} bytes, the listed "
                    f"tensors need {total}"
                )
            arena = self.allocate(arena_meta(metas))
            if total:
                shared = torch.frombuffer(segment.buf, dtype=torch.uint8, count=total)
                arena.copy_(shared)  # one copy for the whole chunk
                del shared  # release the exported buffer before closing the segment
        finally:
            segment.close()
        yield from views(metas, arena)


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open the trainer's segment without registering it with this process's resource
    tracker: the segment is the trainer's to unlink, not ours at exit."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


@dataclass(kw_only=True)
class IPCTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "ipc"
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30


@WeightTransferTrainerFactory.register("ipc")
class IPCTrainer(TrainerWeightTransferEngine):
    info: IPCTrainerInitInfo

    def connect(self) -> None:
        self.client.init_weight_transfer_engine({})
        # Segments live across rounds (writing into fresh shared memory costs page faults:
        # ~3x slower than a warm copy); unlinked by shutdown() or at interpreter exit.
        self.segments: list[shared_memory.SharedMemory] = []
        self._finalizer = weakref.finalize(self, _unlink_all, self.segments)

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        for index, chunk in enumerate(self._chunks(metas)):
            self._send_segment(index, [metas[i] for i in chunk], [tensors[i] for i in chunk])

    def shutdown(self) -> None:
        if hasattr(self, "_finalizer"):
            self._finalizer()

    def _chunks(self, metas: list[ParamMeta]) -> list[list[int]]:
        if not self.info.packed:
            return [list(range(len(metas)))]
        chunks: list[list[int]] = [[]]
        used = 0
        for i, meta in enumerate(metas):
            if chunks[-1] and used + meta.nbytes > self.info.packed_buffer_size_bytes:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += meta.nbytes
        return chunks

    def _segment(self, index: int, size: int) -> shared_memory.SharedMemory:
        if index < len(self.segments) and self.segments[index].size >= size:
            return self.segments[index]
        segment = shared_memory.SharedMemory(
            name=f"hotswap_{secrets.token_hex(8)}", create=True, size=max(size, 1)
        )
        if index < len(self.segments):
            _unlink_all([self.segments[index]])
            self.segments[index] = segment
        else:
            self.segments.append(segment)
        return segment

    def _send_segment(
        self, index: int, metas: list[ParamMeta], tensors: list[torch.Tensor]
    ) -> None:
        if any(t.is_cuda for t in tensors):
            raise ValueError("ipc: CUDA tensors need CUDA IPC (not implemented)")
        total = layout(metas)[1]
        segment = self._segment(index, total)
        if total:
            data = torch.frombuffer(segment.buf, dtype=torch.uint8, count=total)
            for _ in pack(tensors, [data], lambda i: None):  # one torch.cat into the segment
                pass
            del data
        self.client.update_weights({**metas_to_update_info(metas), "shm_name": segment.name})


def _unlink_all(segments: list[shared_memory.SharedMemory]) -> None:
    for segment in segments:
        segment.close()
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()
    segments.clear()
