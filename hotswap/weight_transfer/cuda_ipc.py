"""CUDA IPC handles as JSON: a trainer on the same machine shares its GPU tensors in place
(no copy on its side) and the engine opens them, reading the trainer's memory until the
round's commit copies it into the model.

A handle is PyTorch's own (`torch.multiprocessing.reductions`, which also keeps the
producer's reference counts right); only its plain fields travel, bytes as base64, and the
device as its UUID, since trainer and engine may number the GPUs differently
(CUDA_VISIBLE_DEVICES). A handle cannot be opened by the process that made it, so each also
names its producer: an engine in the same process takes the tensor itself.

Not yet run on a GPU (none was available); `tests/weight_transfer/test_cuda.py` is the check
to run first."""

from __future__ import annotations

import base64
import binascii
import itertools
import os
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta

_BYTES = ("handle", "ref_counter_handle", "event_handle")
_INTS = ("storage_size", "storage_offset", "ref_counter_offset", "tensor_offset")

# Tensors exported by this process, for an engine in the same process (weak: the trainer
# keeps them alive until its round is committed).
_EXPORTED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_EXPORT_IDS = itertools.count()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON form of a CUDA tensor's IPC handle."""
    args = reduce_tensor(tensor)[1]
    (_, _, stride, tensor_offset, _, _, device, handle, size, offset, _, ref_handle,
     ref_offset, event_handle, event_sync) = args  # fmt: skip
    export_id = next(_EXPORT_IDS)
    _EXPORTED[export_id] = tensor
    return {
        "pid": os.getpid(),
        "export_id": export_id,
        "device_uuid": device_uuid(device),
        "handle": _b64(handle),
        "storage_size": size,
        "storage_offset": offset,
        "ref_counter_handle": _b64(ref_handle),
        "ref_counter_offset": ref_offset,
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync),
        "tensor_offset": tensor_offset,
        "stride": list(stride),
    }


def open_handle(meta: ParamMeta, entry: object, field: str) -> torch.Tensor:
    """The trainer's tensor described by `entry` (checked field by field first)."""
    if not isinstance(entry, dict):
        raise InvalidArgument(field, f"{field}: must be a JSON object")
    local = _exported_here(entry)
    if local is not None:
        if local.dtype != meta.dtype or tuple(local.shape) != meta.shape:
            raise InvalidArgument(field, f"{field}: the exported tensor is not {meta.describe()}")
        return local
    raw = {key: _unb64(entry.get(key), f"{field}.{key}") for key in _BYTES}
    ints = {key: _int(entry.get(key), f"{field}.{key}") for key in _INTS}
    stride = entry.get("stride")
    if not isinstance(stride, list) or len(stride) != len(meta.shape):
        raise InvalidArgument(
            f"{field}.stride", f"{field}.stride: one integer per dimension of {list(meta.shape)}"
        )
    stride = [_int(s, f"{field}.stride") for s in stride]
    needed = ints["tensor_offset"] + sum((n - 1) * s for n, s in zip(meta.shape, stride)) + 1
    if meta.numel and needed * meta.dtype.itemsize > ints["storage_size"]:
        raise InvalidArgument(f"{field}.storage_size", f"{field}.storage_size: "
                              f"{ints['storage_size']} bytes do not hold the view "
                              f"({needed * meta.dtype.itemsize} needed)")  # fmt: skip
    if not isinstance(entry.get("event_sync_required"), bool):
        raise InvalidArgument(
            f"{field}.event_sync_required", f"{field}.event_sync_required: must be a boolean"
        )
    device = _local_index(entry.get("device_uuid"), f"{field}.device_uuid")
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=meta.dtype, device=f"cuda:{device}")
    if raw["handle"] is None:
        raise InvalidArgument(f"{field}.handle", f"{field}.handle: required for a non-empty tensor")
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(meta.shape), tuple(stride), ints["tensor_offset"],
            torch.UntypedStorage, meta.dtype, device, raw["handle"], ints["storage_size"],
            ints["storage_offset"], False, raw["ref_counter_handle"],
            ints["ref_counter_offset"], raw["event_handle"],
            bool(entry.get("event_sync_required")),
        )  # fmt: skip
    except (RuntimeError, TypeError) as e:  # a stale or foreign handle, a missing field
        raise InvalidArgument(field, f"{field}: cannot open the CUDA IPC handle ({e})") from None


def _exported_here(entry: dict[str, Any]) -> torch.Tensor | None:
    if entry.get("pid") != os.getpid():
        return None
    export_id = entry.get("export_id")
    return _EXPORTED.get(export_id) if isinstance(export_id, int) else None


def _local_index(uuid: object, field: str) -> int:
    if not torch.cuda.is_available():
        raise InvalidArgument(
            field, f"{field}: this engine has no CUDA device to open the handle on"
        )
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise InvalidArgument(field, f"{field}: GPU {uuid!r} is not visible to the engine")


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(value: object, field: str) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(field, f"{field}: must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise InvalidArgument(field, f"{field}: not valid base64") from None


def _int(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(field, f"{field}: must be a non-negative integer, got {value!r}")
    return value
