"""What moves in a weight update and how both sides describe it (docs/design.md §4).

`ParamMeta` describes one tensor; a `WeightSource` has two channels, `metadata()` and
iteration, that must agree element by element (the sender checks before any byte moves).
Update infos are plain JSON: `names`, `dtype_names`, `shapes` of equal length (their
types: infos.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hotswap.weight_transfer.dtypes import DTYPES, dtype_name
from hotswap.weight_transfer.infos import TensorsInfo, parse_info


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> ParamMeta:
        return cls(name, tensor.dtype, tuple(tensor.shape))

    def describe(self) -> str:
        return f"{self.name} ({dtype_name(self.dtype)}, {list(self.shape)})"


@dataclass(frozen=True)
class Delta:
    """Received from a delta backend instead of a full tensor: set `values` at the flat
    `indices` of the named checkpoint tensor (indices already checked to be in range)."""

    indices: torch.Tensor
    values: torch.Tensor


def metas_to_update_info(metas: Sequence[ParamMeta]) -> dict[str, Any]:
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def metas_from_update_info(info: object) -> list[ParamMeta]:
    """The `names` / `dtype_names` / `shapes` lists of an update info, checked (infos.py's
    `TensorsInfo`: equal lengths, known dtypes, sizes, no name twice). Raises
    InvalidArgument naming the field (`update_info.shapes[2]`)."""
    return metas_of(parse_info(TensorsInfo, info, "update_info"))


def metas_of(info: TensorsInfo) -> list[ParamMeta]:
    """The tensors a parsed update info lists."""
    return [
        ParamMeta(name, DTYPES[dtype.removeprefix("torch.")], tuple(shape))
        for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes)
    ]


class WeightSource(ABC):
    """Trainer-side weights to send. `metadata()` and iteration must agree element by
    element (name, dtype, shape, order): receivers size their buffers from the metadata."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class ModuleSource(WeightSource):
    """The parameters of a `torch.nn.Module`, under their checkpoint (state-dict) names."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta.of(name, p) for name, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            yield name, param.detach()


class TensorSource(WeightSource):
    """An explicit list of (name, tensor): a subset of a model, or a computed update."""

    def __init__(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.tensors = list(tensors)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta.of(name, t) for name, t in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


def checked_items(source: WeightSource) -> tuple[list[ParamMeta], list[torch.Tensor]]:
    """Iterate the source once and compare it with its metadata; raise naming the first
    disagreement before anything is sent."""
    metas = source.metadata()
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"weight source: {duplicate!r} appears twice in metadata()")
    tensors: list[torch.Tensor] = []
    for i, (name, tensor) in enumerate(source):
        if i >= len(metas):
            raise ValueError(
                f"weight source: iteration yields more tensors than metadata() lists "
                f"({len(metas)}); first extra: {name!r}"
            )
        actual, declared = ParamMeta.of(name, tensor), metas[i]
        if actual != declared:
            raise ValueError(
                f"weight source: element {i} disagrees: metadata says "
                f"{declared.describe()}, iteration gives {actual.describe()}"
            )
        tensors.append(tensor)
    if len(tensors) < len(metas):
        raise ValueError(
            f"weight source: iteration stopped after {len(tensors)} tensors, metadata() "
            f"lists {len(metas)}; first missing: {metas[len(tensors)].name!r}"
        )
    return metas, tensors
