"""`disk`: weights from a safetensors directory (the same round, validation and commit as
every backend; also behind SGLang's `/update_weights_from_disk`). The trainer side writes
its source as safetensors into a directory and points the engine at it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hotswap.model.loader import iter_safetensors, safetensors_files
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.engine import WeightTransferEngine, register_backend
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)


def _files(update_info: dict[str, Any]) -> list[Path]:
    path = update_info.get("model_path")
    if not isinstance(path, str) or not path or not Path(path).is_dir():
        raise ValueError(f"model_path: {path!r} is not a directory")
    try:
        return safetensors_files(Path(path))
    except FileNotFoundError as e:
        raise ValueError(f"model_path: {e}") from None


@register_backend("disk")
class DiskEngine(WeightTransferEngine):
    backend: ClassVar[str] = "disk"
    needs_init: ClassVar[bool] = False

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Nothing to set up."""

    def parse_update_info(self, update_info: dict[str, Any]) -> list[ParamMeta]:
        if not isinstance(update_info, dict):
            raise ValueError("update_info: must be a JSON object")
        metas = []
        for path in _files(update_info):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    sliced = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(sliced.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{path.name}: {name} has unsupported dtype")
                    metas.append(ParamMeta(name, dtype, tuple(sliced.get_shape())))
        return metas

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iter_safetensors(_files(update_info))


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


SYNC_FILE = "hotswap-sync.safetensors"


@dataclass(kw_only=True)
class DiskTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "disk"
    directory: str  # must be readable by the engine at the same path


@WeightTransferTrainerFactory.register("disk")
class DiskTrainer(TrainerWeightTransferEngine):
    info: DiskTrainerInitInfo

    def connect(self) -> None:
        directory = Path(self.info.directory)
        directory.mkdir(parents=True, exist_ok=True)
        # The engine loads every *.safetensors file here, so the directory must hold only
        # ours (and we never delete a file we did not write).
        foreign = [p.name for p in directory.glob("*.safetensors") if p.name != SYNC_FILE]
        if foreign or (directory / "model.safetensors.index.json").exists():
            raise ValueError(
                f"directory: {directory} already holds a checkpoint ({', '.join(foreign)}); "
                f"give the disk backend a directory of its own"
            )

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        directory = Path(self.info.directory)
        weights = {m.name: t.detach().contiguous().cpu() for m, t in zip(metas, tensors)}
        partial = directory / f".{SYNC_FILE}.partial"
        save_file(weights, str(partial))
        partial.replace(directory / SYNC_FILE)  # the engine never reads a half-written file
        self.client.update_weights({"model_path": str(directory)})
