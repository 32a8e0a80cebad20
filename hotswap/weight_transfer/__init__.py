"""Weight transfer from a trainer into running engines (docs/design.md §4).

Public names are imported lazily: `hotswap.config` imports the leaf module
`hotswap.weight_transfer.config`, which runs this file first; importing the backends here
would pull every backend (torch.distributed, httpx) into each import of `hotswap.config`."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ParamMeta": "base",
    "WeightSource": "base",
    "ModuleSource": "base",
    "TensorSource": "base",
    "WeightTransferConfig": "config",
    "WeightTransferEngine": "engine",
    "register_backend": "engine",
    "TrainerInitInfo": "trainer",
    "TrainerWeightTransferEngine": "trainer",
    "register_trainer": "trainer",
    "WeightTransferTrainerFactory": "backends",
    "GlooTrainerInitInfo": "broadcast_trainer",
    "NCCLTrainerInitInfo": "broadcast_trainer",
    "IPCTrainerInitInfo": "ipc",
    "DiskTrainerInitInfo": "disk",
    "SparseTrainerInitInfo": "sparse",
    "SparsePatch": "sparse",
    "diff_patches": "sparse",
    "WeightSyncClient": "clients",
    "CommittedWeights": "clients",
    "GroupCommittedWeights": "clients",
    "WeightSyncError": "clients",
    "HTTPWeightSyncClient": "clients",
    "InProcessWeightSyncClient": "clients",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hotswap.weight_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hotswap.weight_transfer.{_EXPORTS[name]}"), name)
