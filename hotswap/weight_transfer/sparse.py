"""`sparse`: delta patches — flat indices + new values per checkpoint tensor — broadcast
over the same group as `gloo`/`nccl`. The wire cost is proportional to the number of
changed elements, and so is the engine's work: patches are validated (names, shapes,
index ranges) and staged as indices + values, then written in place at the commit.

update_info: names, dtype_names (of the values), shapes (full checkpoint shapes) and nnz;
the data stream is, per patch, its indices (int32 while every tensor has < 2**31
elements, else int64) then its values."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hotswap.weight_transfer.base import Delta, ParamMeta, metas_to_update_info
from hotswap.weight_transfer.broadcast import BroadcastEngine
from hotswap.weight_transfer.broadcast_trainer import BroadcastTrainer, GlooTrainerInitInfo
from hotswap.weight_transfer.clients import Committed
from hotswap.weight_transfer.engine import register_backend
from hotswap.weight_transfer.infos import Info, SparseInfo
from hotswap.weight_transfer.trainer import register_trainer, run_alongside


@dataclass(frozen=True)
class SparsePatch:
    """Set `values` at the flat `indices` of checkpoint tensor `name` (shape `shape`)."""

    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor  # int64, 1-D
    values: torch.Tensor  # 1-D, same length

    def __post_init__(self) -> None:
        if self.indices.dim() != 1 or self.values.dim() != 1:
            raise ValueError(f"patch {self.name!r}: indices and values must be 1-D")
        if self.indices.numel() != self.values.numel():
            raise ValueError(f"patch {self.name!r}: {self.indices.numel()} indices but "
                             f"{self.values.numel()} values")  # fmt: skip


def diff_patches(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
) -> list[SparsePatch]:
    """The patches that turn `before` into `after` (same names and shapes): only the
    elements that changed."""
    patches = []
    for name, new in after.items():
        old = before[name]
        changed = (new.reshape(-1) != old.reshape(-1)).nonzero().reshape(-1)
        if changed.numel():
            values = new.reshape(-1)[changed]
            patches.append(SparsePatch(name, tuple(new.shape), changed.to(torch.int64), values))
    return patches


def index_dtype(metas: Sequence[ParamMeta]) -> torch.dtype:
    """int32 indices while every tensor has fewer than 2**31 elements (half the bytes)."""
    return torch.int32 if all(m.numel < 2**31 for m in metas) else torch.int64


def _wire_metas(metas: Sequence[ParamMeta], nnz: Sequence[int]) -> list[ParamMeta]:
    indices = index_dtype(metas)
    wire = []
    for meta, count in zip(metas, nnz):
        wire.append(ParamMeta(f"{meta.name}#indices", indices, (count,)))
        wire.append(ParamMeta(f"{meta.name}#values", meta.dtype, (count,)))
    return wire


@register_backend("sparse")
class SparseEngine(BroadcastEngine):
    """Yields `Delta`s: the engine stages only indices and values (O(changed elements))
    and writes them into the loaded weights at commit."""

    backend: ClassVar[str] = "sparse"
    sends_deltas: ClassVar[bool] = True

    update_info_cls: ClassVar[type[Info]] = SparseInfo

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, Delta]]:
        if self.channel is None:
            raise RuntimeError("no broadcast group: call init_weight_transfer_engine first")
        fresh = lambda m: torch.empty(m.shape, dtype=m.dtype, device=self.device)  # noqa: E731
        received = self.channel.receive(_wire_metas(metas, update_info["nnz"]), fresh)
        for i, meta in enumerate(metas):
            indices, values = received[2 * i][1], received[2 * i + 1][1]
            if indices.numel():
                low, high = (int(v) for v in torch.aminmax(indices))
                if low < 0 or high >= meta.numel:
                    raise ValueError(
                        f"patch {meta.name!r}: an index is outside 0..{meta.numel - 1}"
                    )
            yield meta.name, Delta(indices, values)  # int32 or int64: both index tensors


@dataclass(kw_only=True)
class SparseTrainerInitInfo(GlooTrainerInitInfo):
    backend: ClassVar[str] = "sparse"


@register_trainer("sparse")
class SparseTrainer(BroadcastTrainer):
    """Patches, not a source: `send_patches(patches, weight_version)` runs one whole round
    (an empty list is a no-op). Every trainer rank calls it; rank 0 sends."""

    def send_weights(
        self, weight_version: str | None = None, *, digest: bool = False
    ) -> Committed | None:
        raise TypeError("sparse: call send_patches(patches, weight_version) instead")

    def send_patches(
        self,
        patches: Sequence[SparsePatch],
        weight_version: str | None = None,
        *,
        digest: bool = False,
    ) -> Committed | None:
        """What was committed, as `send_weights` (None on other ranks or for no patches)."""
        if not self.is_sender or not patches:
            return None
        metas = [ParamMeta(p.name, p.values.dtype, p.shape) for p in patches]
        info = {**metas_to_update_info(metas), "nnz": [p.indices.numel() for p in patches]}
        indices = index_dtype(metas)
        tensors = [t for p in patches for t in (p.indices.to(indices), p.values)]
        return self.run_round(
            lambda: run_alongside(
                lambda: self.client.update_weights(info), lambda: self.channel.send(tensors)
            ),
            weight_version,
            digest,
        )
