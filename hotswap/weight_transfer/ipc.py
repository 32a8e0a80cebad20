"""`ipc`: a trainer on the same machine hands over weights through named shared memory.

The update info is JSON: the usual names / dtype_names / shapes, plus either `segments`
(segment names) and `placements` (`[segment index, byte offset]` per tensor) for host
memory, or `cuda_ipc` (one CUDA IPC handle per tensor, see cuda_ipc.py) for GPU memory. No
pickle crosses the control plane. The engine maps the segments (mappings are kept across
rounds) or opens the handles and stages views: nothing is copied until `finish` writes
the model.

Trainer side, a tensor reaches a segment one of two ways:
- it already lives in one (`share_module_memory(model)`, or `IPCTrainerInitInfo(
  share_source=True)` which does that to the source's module once): it is sent in place, so
  a round copies each weight exactly once, from the trainer's parameters into the engine's;
- otherwise it is packed into staging segments the trainer keeps across rounds (packed mode
  bounds each to `packed_buffer_size_bytes`; a larger tensor gets one of its own).

A trainer's CUDA tensors always travel as CUDA IPC handles to the tensors themselves (no
copy on the trainer's side), whatever device the engine runs on.

Same-machine trust: the engine reads the trainer's memory between `update` and `finish`, so
the trainer must not change the sent tensors until `send_weights()` returns (it blocks until
then)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ModuleSource, ParamMeta, metas_to_update_info
from hotswap.weight_transfer.cuda_ipc import export_handle, open_handle
from hotswap.weight_transfer.engine import WeightTransferEngine, register_backend
from hotswap.weight_transfer.infos import Info, IPCInfo
from hotswap.weight_transfer.packing import layout, pack
from hotswap.weight_transfer.shm import Segment, check_available, check_name
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    register_trainer,
)


@register_backend("ipc")
class IPCEngine(WeightTransferEngine):
    backend: ClassVar[str] = "ipc"
    needs_init: ClassVar[bool] = False
    update_info_cls: ClassVar[type[Info]] = IPCInfo

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # Kept across rounds (remapping costs page faults), until a round stops using them:
        # the engine holds the trainer's last segments until the next round or shutdown.
        self._mapped: dict[str, Segment] = {}
        self._used: set[str] = set()
        # CUDA tensors opened this round and last: reopening a handle whose storage is still
        # open reuses it (PyTorch's cache) instead of opening another IPC mapping and event.
        self._cuda_open: list[torch.Tensor] = []
        self._cuda_kept: list[torch.Tensor] = []

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        check_available()

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Views of the trainer's memory, valid for the rest of the round (`update_info`
        is as `parse_update_info` checked it: IPCInfo)."""
        if update_info.get("cuda_ipc") is not None:
            opened = [  # every handle checked and opened before anything is staged
                (meta.name, open_handle(meta, entry, f"update_info.cuda_ipc[{i}]"))
                for i, (meta, entry) in enumerate(zip(metas, update_info["cuda_ipc"]))
            ]
            self._cuda_open.extend(t for _, t in opened)
            return iter(opened)
        segments = [self._segment(name, f"update_info.segments[{i}]") for i, name in
                    enumerate(update_info["segments"])]  # fmt: skip
        views = [  # every placement checked before anything is staged
            (meta.name, _view(segments[index], meta, offset, f"update_info.placements[{i}]"))
            for i, (meta, (index, offset)) in enumerate(zip(metas, update_info["placements"]))
        ]
        return iter(views)

    def _segment(self, name: object, field: str) -> Segment:
        name = check_name(name, field)
        segment = self._mapped.get(name)
        if segment is None or not segment.is_current():
            try:
                segment = Segment.attach(name)
            except ValueError as e:
                raise InvalidArgument(field, f"{field}: {e}") from None
            self._mapped[name] = segment
        self._used.add(name)
        return segment

    def finish_weight_update(self) -> None:
        # Unmap segments this round did not use (staged views keep their own mapping).
        self._mapped = {n: s for n, s in self._mapped.items() if n in self._used}
        self._used = set()
        self._cuda_kept, self._cuda_open = self._cuda_open, []

    def shutdown(self) -> None:
        self._mapped, self._used = {}, set()
        self._cuda_open, self._cuda_kept = [], []


def _view(segment: Segment, meta: ParamMeta, offset: int, field: str) -> torch.Tensor:
    if offset % meta.dtype.itemsize:
        raise InvalidArgument(field, f"{field}: offset {offset} is not aligned to {meta.dtype}")
    if offset + meta.nbytes > segment.size:
        raise InvalidArgument(
            field,
            f"{field}: {meta.name!r} needs bytes {offset}..{offset + meta.nbytes}, segment "
            f"{segment.name!r} holds {segment.size}",
        )
    return segment.data[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape)


# -- trainer side ---------------------------------------------------------------------------

# Segments holding shared parameters, by the address of their mapping. Weak: a segment
# lives (and keeps its name) as long as the module it was made for.
_SHARED: weakref.WeakValueDictionary[int, Segment] = weakref.WeakValueDictionary()


def share_module_memory(module: nn.Module) -> Segment | None:
    """Move the module's CPU parameters into one shared-memory segment, in place (the
    Parameter objects stay, so optimizers keep working; each keeps a storage of its own,
    so checkpointing works as before); the `ipc` backend then sends them without copying.
    CUDA parameters stay where they are (they travel as CUDA IPC handles). Returns the
    segment (None if there is nothing to move); it stays alive with the module. Calling it
    again moves only parameters that left shared memory."""
    params = [
        p
        for p in dict.fromkeys(module.parameters())
        if p.device.type == "cpu" and p.numel() and _locate(p) is None
    ]
    if not params:
        return None
    metas = [ParamMeta("", p.dtype, tuple(p.shape)) for p in params]
    offsets, total = layout(metas)
    segment = Segment.create(total)
    with torch.no_grad():
        for param, meta, offset in zip(params, metas, offsets):
            view = segment.view(meta.dtype, offset, meta.numel).view(meta.shape)
            view.copy_(param)
            param.data = view
    _SHARED[segment.data.data_ptr()] = segment
    kept = module.__dict__.setdefault("_hotswap_shared_segments", [])
    kept.append(segment)
    return segment


def _locate(tensor: torch.Tensor) -> tuple[Segment, int] | None:
    """(segment, byte offset) if the tensor lies contiguously in a shared segment."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return None
    start = tensor.data_ptr()
    for base, segment in list(_SHARED.items()):
        if base <= start and start + tensor.nbytes <= base + segment.size:
            return segment, start - base
    return None


@dataclass(kw_only=True)
class IPCTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "ipc"
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30
    # Move the ModuleSource's parameters into shared memory once (see share_module_memory).
    share_source: bool = False


@register_trainer("ipc")
class IPCTrainer(TrainerWeightTransferEngine):
    info: IPCTrainerInitInfo

    def connect(self) -> None:
        check_available()
        if self.info.share_source:
            if not isinstance(self.source, ModuleSource):
                raise InvalidArgument(
                    "share_source", "IPCTrainerInitInfo.share_source: needs a ModuleSource"
                )
            share_module_memory(self.source.module)
        self.client.init_weight_transfer_engine({})
        # Staging segments live across rounds (writing into fresh shared memory costs page
        # faults: ~3x slower than a warm copy); unlinked by shutdown() or at exit.
        self.staging: list[Segment] = []

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        on_gpu = [i for i, t in enumerate(tensors) if t.is_cuda]
        if on_gpu:
            for device in {tensors[i].device for i in on_gpu}:
                torch.cuda.synchronize(device)  # the engine reads on its own streams
            self.client.update_weights(
                {
                    **metas_to_update_info([metas[i] for i in on_gpu]),
                    "cuda_ipc": [export_handle(tensors[i]) for i in on_gpu],
                }
            )
        located = [None if t.is_cuda else _locate(t) for t in tensors]
        in_place = [(i, *found) for i, found in enumerate(located) if found is not None]
        to_stage = [
            i for i, found in enumerate(located) if found is None and not tensors[i].is_cuda
        ]
        calls = [in_place] if in_place else []
        for number, chunk in enumerate(self._chunks([metas[i] for i in to_stage])):
            indices = [to_stage[c] for c in chunk]
            chunk_metas = [metas[i] for i in indices]
            segment = self._stage(number, chunk_metas, [tensors[i] for i in indices])
            offsets = layout(chunk_metas)[0]
            calls.append([(i, segment, offset) for i, offset in zip(indices, offsets)])
        for placed in calls:
            self._update(metas, placed)

    def _update(self, metas: list[ParamMeta], placed: list[tuple[int, Segment, int]]) -> None:
        segment_index: dict[str, int] = {}
        placements = [
            [segment_index.setdefault(segment.name, len(segment_index)), offset]
            for _, segment, offset in placed
        ]
        self.client.update_weights(
            {
                **metas_to_update_info([metas[i] for i, _, _ in placed]),
                "segments": list(segment_index),
                "placements": placements,
            }
        )

    def shutdown(self) -> None:
        for segment in getattr(self, "staging", []):
            segment.unlink()
        self.staging = []

    def _chunks(self, metas: list[ParamMeta]) -> list[list[int]]:
        if not metas:
            return []
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

    def _stage(self, index: int, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> Segment:
        """Pack `tensors` into staging segment `index` (grown when too small)."""
        total = layout(metas)[1]
        if index == len(self.staging):
            self.staging.append(Segment.create(total))
        elif self.staging[index].size < total:
            self.staging[index].unlink()
            self.staging[index] = Segment.create(total)
        segment = self.staging[index]
        if total:
            for _ in pack(tensors, [segment.data[:total]], lambda i: None):  # one torch.cat
                pass
        return segment
