"""Broadcast over a torch.distributed group: the trainer is rank 0, engine workers are
rank_offset + i (TRL's layout instead puts the trainer last: `trainer_rank`). gloo on CPU,
NCCL on CUDA, same code. Packed mode streams the tensors' bytes through rotating
fixed-size buffers (packing the next while the last one is in flight); unpacked mode sends
one tensor at a time.

The group is built from its own TCPStore (no global process group), so a trainer can keep
its training groups and an engine can be re-initialised after a failure; rendezvous.py
forms it, cancellably whichever rank hosts the store."""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.engine import WeightTransferEngine, register_backend
from hotswap.weight_transfer.infos import (  # noqa: F401 - the defaults, also for trainers
    DEFAULT_BUFFER_BYTES,
    DEFAULT_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    BroadcastInitInfo,
    Info,
)
from hotswap.weight_transfer.packing import arena_meta, buffer_lengths, byte_view, pack, views
from hotswap.weight_transfer.rendezvous import join_group

# Groups still open at interpreter exit are released by an atexit hook, while the runtime
# is whole: a gloo group destroyed during finalisation can abort the process
# ("terminate called without an active exception").
_OPEN_CHANNELS: weakref.WeakSet[BroadcastChannel] = weakref.WeakSet()


@atexit.register
def _close_open_channels() -> None:
    for channel in list(_OPEN_CHANNELS):
        channel.close()
    gc.collect()


class BroadcastChannel:
    """One side of the group; the same send/receive code runs on gloo and NCCL."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        packed: bool,
        size: int,
        count: int,
        src: int = 0,
        typed: bool = False,
    ) -> None:
        self.group: dist.ProcessGroup | None = group
        self.device = device
        self.src = src  # the sender's (trainer's) rank: 0, or the last in TRL's layout
        # Unpacked, each tensor as one broadcast of its own dtype, empty ones included, as
        # a torch-helper trainer (SGLang's protocol) sends them; otherwise as bytes.
        self.typed = typed
        self.packed, self.buffer_size, self.num_buffers = packed, size, count
        # The sender's packing buffers, kept across rounds: packing into fresh memory costs
        # page faults (about twice as slow as into warm memory).
        self._send_buffers: list[torch.Tensor] = []
        _OPEN_CHANNELS.add(self)

    def close(self) -> None:
        self.group = None  # the last reference: its destructor stops gloo's threads
        self._send_buffers = []

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        if self.group is None:
            raise RuntimeError("broadcast channel is closed")
        if tensor.dtype == torch.float8_e4m3fn:  # gloo has no float8: its bytes (NCCL's way)
            tensor = tensor.view(torch.uint8)
        return self.group.broadcast(tensor, self.src)

    def _buffers(self) -> list[torch.Tensor]:
        if not self._send_buffers:
            self._send_buffers = [
                torch.empty(self.buffer_size, dtype=torch.uint8, device=self.device)
                for _ in range(self.num_buffers)
            ]
        return self._send_buffers

    def send(self, tensors: Sequence[torch.Tensor]) -> None:
        if not self.packed:
            for tensor in tensors:
                if self.typed:
                    self._broadcast(tensor.to(self.device).contiguous()).wait()
                elif tensor.numel():
                    self._broadcast(byte_view(tensor.to(self.device).contiguous())).wait()
            return
        buffers = self._buffers()
        works: dict[int, dist.Work] = {}

        def wait_for(index: int) -> None:
            if index in works:
                works.pop(index).wait()

        for index, used in pack(tensors, buffers, wait_for):
            works[index] = self._broadcast(buffers[index][:used])
        for work in works.values():
            work.wait()

    def receive(
        self, metas: Sequence[ParamMeta], allocate: Callable[[ParamMeta], torch.Tensor]
    ) -> list[tuple[str, torch.Tensor]]:
        if not self.packed:
            out = []
            for meta in metas:
                tensor = allocate(meta)
                if self.typed:
                    self._broadcast(tensor).wait()
                elif tensor.numel():
                    self._broadcast(byte_view(tensor)).wait()
                out.append((meta.name, tensor))
            self._synchronize()
            return out
        # Receive straight into one flat layout (distinct memory per buffer, so every
        # broadcast can be posted at once); the tensors are views of it.
        arena = allocate(arena_meta(metas))
        works, start = [], 0
        for length in buffer_lengths(metas, self.buffer_size):
            works.append(self._broadcast(arena[start : start + length]))
            start += length
        for work in works:
            work.wait()
        self._synchronize()
        return views(metas, arena)

    def _synchronize(self) -> None:
        """On CUDA, `wait()` only orders streams: block until the bytes are here, so a
        failed transfer surfaces in this update call, not in a later model step."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class BroadcastEngine(WeightTransferEngine):
    """Worker side. init_info: master_address, master_port, rank_offset, world_size, and
    the trainer's wire settings (packed, packed_buffer_size_bytes, packed_num_buffers,
    timeout_s). `trainer_rank` (default 0) is the sender's rank; TRL's layout is
    trainer_rank = world_size - 1 with workers from rank_offset 0, and rank 0 (then a
    worker) hosts the store, listening on master_address. With `group_name`, the trainer
    made the group with torch's process-group helpers under that name (SGLang's
    init_weights_update_group protocol): the keys are theirs (`torch_group_store`) and every
    tensor is one broadcast of its own dtype (unpacked: `packed` must be false, its default
    then)."""

    backend: ClassVar[str] = "gloo"
    init_info_cls: ClassVar[type[Info]] = BroadcastInitInfo

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.channel: BroadcastChannel | None = None

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = self.parse_init_info(init_info)
        assert isinstance(info, BroadcastInitInfo)
        self.check_master_address(info.master_address)
        self.shutdown()
        try:
            group = join_group(info.master_address, info.master_port, info.rank,
                               info.world_size, self.device, info.timeout_s, self.cancel,
                               info.group_name)  # fmt: skip
        except InvalidArgument as e:
            if e.field != "master_address":  # this worker is rank 0 (trainer_rank > 0)
                raise
            raise InvalidArgument("init_info.master_address", f"init_info.{e}") from None
        self.channel = BroadcastChannel(
            group, self.device, info.is_packed, info.packed_buffer_size_bytes,
            info.packed_num_buffers, info.trainer_rank, typed=info.group_name is not None,
        )  # fmt: skip

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if self.channel is None:
            raise RuntimeError("no broadcast group: call init_weight_transfer_engine first")
        yield from self.channel.receive(metas, self.allocate)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None


@register_backend("gloo")
class GlooEngine(BroadcastEngine):
    backend = "gloo"
    group_device = "cpu"


@register_backend("nccl")
class NCCLEngine(BroadcastEngine):
    backend = "nccl"
    group_device = "cuda"
