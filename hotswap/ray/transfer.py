"""`ray`: weights through Ray's object store, for engines that are Ray actors.

The trainer puts each chunk of the round (at most `chunk_bytes`, a larger tensor alone) in
the object store once, as a list of flat byte arrays, one per tensor, and passes its
`ObjectRef` in the update call to every engine actor at once: the store moves it to each
node that asks (on one node, engines read the same shared memory), and the actor resolves
it before the engine sees the call (`deliver`). The update info the engine's verb receives
stays JSON: the usual names / dtype_names / shapes plus `object`, the key under which the
actor left the chunk's arrays for the engine core of its own process.

The engine stages views of the delivered arrays (zero copy; they keep the store's buffer
alive) and copies them into its weights at `finish`, as the ipc backend does."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import ray
import torch

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta, metas_to_update_info
from hotswap.weight_transfer.engine import WeightTransferEngine, register_backend
from hotswap.weight_transfer.packing import byte_view
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    register_trainer,
)

OBJECT = "object"  # the update info's key: an ObjectRef on the way in, a mailbox key after
DEFAULT_CHUNK_BYTES = 256 << 20

# Chunks an engine actor resolved and its engine core (same process) has yet to take,
# by key. Filled and emptied by `deliver` around each update call.
_MAILBOX: dict[str, list[np.ndarray]] = {}


class deliver:  # noqa: N801 - used as a context manager, reads as a verb
    """Actor side, around one update call: resolve the ObjectRef in `update_info`, leave
    its arrays in the mailbox, and give the engine the JSON form (`info`)."""

    def __init__(self, update_info: dict[str, Any], arrays: list[np.ndarray]) -> None:
        self.key = uuid.uuid4().hex
        self.info = {**update_info, OBJECT: self.key}
        _MAILBOX[self.key] = arrays

    def __enter__(self) -> dict[str, Any]:
        return self.info

    def __exit__(self, *exc: object) -> None:
        _MAILBOX.pop(self.key, None)


@register_backend("ray")
class RayObjectEngine(WeightTransferEngine):
    backend: ClassVar[str] = "ray"
    needs_init: ClassVar[bool] = False

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Nothing to join: every chunk names its own object."""

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        key = update_info.get(OBJECT)
        arrays = _MAILBOX.get(key) if isinstance(key, str) else None
        if arrays is None:
            raise InvalidArgument(
                f"update_info.{OBJECT}",
                f"update_info.{OBJECT}: no chunk delivered under {key!r}; the ray backend "
                "receives through a hotswap.ray engine actor (RayEngineGroup / RayEngineClient)",
            )
        if len(arrays) != len(metas):
            raise InvalidArgument(
                f"update_info.{OBJECT}",
                f"update_info.{OBJECT}: the object holds {len(arrays)} tensors, the update "
                f"names {len(metas)}",
            )
        views = [_view(meta, array, i) for i, (meta, array) in enumerate(zip(metas, arrays))]
        return iter(views)  # every tensor checked before anything is staged


def _view(meta: ParamMeta, array: object, index: int) -> tuple[str, torch.Tensor]:
    field = f"update_info.{OBJECT}[{index}]"
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise InvalidArgument(field, f"{field}: must be a flat uint8 array of the tensor's bytes")
    if array.nbytes != meta.nbytes:
        raise InvalidArgument(
            field,
            f"{field}: {array.nbytes} bytes, but {meta.name!r} ({meta.dtype}, "
            f"{list(meta.shape)}) is {meta.nbytes} bytes",
        )
    if not meta.numel:
        return meta.name, torch.empty(meta.shape, dtype=meta.dtype)
    with warnings.catch_warnings():  # the store's memory is read-only; staged views only read
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        raw = torch.frombuffer(array, dtype=torch.uint8)
    return meta.name, raw.view(meta.dtype).view(meta.shape)


# -- trainer side ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class RayTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "ray"
    # Bytes per object (a tensor larger than this travels alone): big enough to amortise
    # each call, small enough that the store never needs one object the size of the model.
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


@register_trainer("ray")
class RayTrainer(TrainerWeightTransferEngine):
    info: RayTrainerInitInfo

    def connect(self) -> None:
        size = self.info.chunk_bytes
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgument("chunk_bytes", f"chunk_bytes: must be a positive integer, "
                                                 f"got {size!r}")  # fmt: skip
        if not getattr(self.client, "accepts_object_refs", False):
            raise InvalidArgument(
                "client",
                "client: the ray backend sends ObjectRefs, which only a hotswap.ray client "
                "carries (RayEngineGroup or RayEngineClient)",
            )
        self.client.init_weight_transfer_engine({})

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        for chunk in chunks(metas, self.info.chunk_bytes):
            arrays = [_host_bytes(tensors[i]) for i in chunk]
            ref = ray.put(arrays)  # one copy, into the store; the engines read it in place
            try:
                info = metas_to_update_info([metas[i] for i in chunk])
                self.client.update_weights({**info, OBJECT: ref})
            finally:
                del ref  # the store frees the chunk once the engines have staged it


def chunks(metas: list[ParamMeta], limit: int) -> list[list[int]]:
    """Consecutive tensors up to `limit` bytes per chunk; one larger tensor alone."""
    out: list[list[int]] = [[]]
    used = 0
    for i, meta in enumerate(metas):
        if out[-1] and used + meta.nbytes > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += meta.nbytes
    return [chunk for chunk in out if chunk]


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array in host memory (a view where possible)."""
    flat = byte_view(tensor.detach().to("cpu").contiguous())
    return flat.numpy()
