"""`disk`: weights from a safetensors directory (the same round, validation and commit as
every backend; also behind SGLang's `/update_weights_from_disk`). The trainer side writes
its source as safetensors into a directory and points the engine at it."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hotswap.errors import InvalidArgument, nested
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.dtypes import SAFETENSORS_DTYPES
from hotswap.weight_transfer.engine import WeightTransferEngine, register_backend
from hotswap.weight_transfer.infos import MAX_PATH_CHARS, DiskInfo, Info, parse_info
from hotswap.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    register_trainer,
)
from hotswap.weights.checkpoint import iter_safetensors, safetensors_files

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
INDEX_FILE = "model.safetensors.index.json"


def _files(update_info: dict[str, Any], allowed: tuple[Path, ...] | None) -> list[Path]:
    """The checkpoint's files, by real path, each confined to `allowed` (None: anywhere)
    and checked (see `check_safetensors`) before any is read. Refusals name `model_path`
    (the key of `update_info`)."""
    path = update_info.get("model_path")
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise InvalidArgument(
            "model_path",
            f"model_path: must be a directory path of at most {MAX_PATH_CHARS} characters",
        )
    shown = path if len(path) <= 200 else path[:200] + "..."
    try:
        # Confined before anything else is looked at, so a caller cannot even learn what
        # exists outside the allowed directories.
        directory = confine(Path(path), allowed, repr(shown))
        if not directory.is_dir():
            raise InvalidArgument("model_path", f"model_path: {shown!r} is not a directory")
        # The index is read (for its weight_map) before the files it names.
        confine(directory / INDEX_FILE, allowed, f"{INDEX_FILE} in {shown!r}")
        files = [
            confine(file, allowed, f"{file.name[:200]!r} in {shown!r}")
            for file in safetensors_files(directory)
        ]
        for file in files:
            check_safetensors(file)
    except FileNotFoundError as e:
        raise InvalidArgument("model_path", f"model_path: {e}") from None
    except (OSError, KeyError, TypeError, RecursionError) as e:  # also a bad index file
        raise InvalidArgument(
            "model_path", f"model_path: cannot read a checkpoint in {shown!r} ({e!r})"
        ) from None
    return files


def confine(path: Path, allowed: tuple[Path, ...] | None, shown: str) -> Path:
    """The real path of `path` (every symlink resolved); InvalidArgument unless it lies inside
    one of the `allowed` real directories (None: no confinement). Callers then open the
    real path, so only a writer inside an allowed directory could swap a link in between."""
    real = Path(os.path.realpath(path))
    if allowed is None or any(real == d or d in real.parents for d in allowed):
        return real
    dirs = ", ".join(str(d) for d in allowed) or "none"
    raise InvalidArgument(
        "model_path",
        f"model_path: {shown} is outside the directories weights may be loaded from "
        f"({dirs}; set at server start with --allowed-weight-dirs)",
    )


def check_safetensors(path: Path) -> None:
    """InvalidArgument (`model_path`) unless `path` is a regular file whose header is a
    safetensors header that tells the truth: every tensor's bytes lie inside the file and
    match its dtype and shape (a header may claim a 100 GB tensor in a 16-byte file)."""
    # O_NONBLOCK: a FIFO named *.safetensors must not block the open.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument("model_path", f"model_path: {path.name} is not a regular file")
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, info.st_size - 8):
            raise InvalidArgument(
                "model_path", f"model_path: {path.name} is not a safetensors file"
            )
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            raise InvalidArgument(
                "model_path", f"model_path: {path.name} has a corrupt header"
            ) from None
    data_size = info.st_size - 8 - length
    if not isinstance(header, dict):
        raise InvalidArgument("model_path", f"model_path: {path.name} has a corrupt header")
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path.name, name, entry, data_size)


def _check_entry(file: str, name: str, entry: object, data_size: int) -> None:
    where = f"model_path: {file}: tensor {name[:200]!r}"
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise InvalidArgument("model_path", f"{where}: missing or unsupported dtype")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise InvalidArgument(
            "model_path", f"{where}: shape must be a list of non-negative integers"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise InvalidArgument("model_path", f"{where}: data_offsets must be [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * SAFETENSORS_DTYPES[entry["dtype"]].itemsize
    if not begin <= end <= data_size or end - begin != nbytes:
        raise InvalidArgument(
            "model_path",
            f"{where}: declares {nbytes} bytes at [{begin}, {end}), but the file holds "
            f"{data_size} bytes of data",
        )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@register_backend("disk")
class DiskEngine(WeightTransferEngine):
    backend: ClassVar[str] = "disk"
    needs_init: ClassVar[bool] = False
    update_info_cls: ClassVar[type[Info]] = DiskInfo  # then read inside allowed_dirs only

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Nothing to set up."""

    def parse_update_info(self, update_info: dict[str, Any]) -> list[ParamMeta]:
        parse_info(DiskInfo, update_info, "update_info")
        with nested("update_info"):  # what follows names update_info's `model_path`
            return self._metas(_files(update_info, self.allowed_dirs))

    @staticmethod
    def _metas(files: list[Path]) -> list[ParamMeta]:
        metas = []
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                        sliced = f.get_slice(name)
                        dtype = SAFETENSORS_DTYPES.get(sliced.get_dtype())
                        if dtype is None:
                            raise InvalidArgument(
                                "model_path", f"{path.name}: {name} has unsupported dtype"
                            )
                        metas.append(ParamMeta(name, dtype, tuple(sliced.get_shape())))
            except SafetensorError as e:
                raise InvalidArgument(
                    "model_path", f"model_path: {path.name} is not readable ({e})"
                ) from None
        return metas

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        with nested("update_info"):
            files = _files(update_info, self.allowed_dirs)
        yield from iter_safetensors(files)


SYNC_FILE = "hotswap-sync.safetensors"


@dataclass(kw_only=True)
class DiskTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "disk"
    directory: str  # must be readable by the engine at the same path


@register_trainer("disk")
class DiskTrainer(TrainerWeightTransferEngine):
    info: DiskTrainerInitInfo

    def connect(self) -> None:
        directory = Path(self.info.directory)
        directory.mkdir(parents=True, exist_ok=True)
        # The engine loads every *.safetensors file here, so the directory must hold only
        # ours (and we never delete a file we did not write).
        foreign = [p.name for p in directory.glob("*.safetensors") if p.name != SYNC_FILE]
        if foreign or (directory / "model.safetensors.index.json").exists():
            raise InvalidArgument(  # DiskTrainerInitInfo.directory
                "directory",
                f"directory: {directory} already holds a checkpoint ({', '.join(foreign)}); "
                f"give the disk backend a directory of its own",
            )

    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        directory = Path(self.info.directory)
        weights = {m.name: t.detach().contiguous().cpu() for m, t in zip(metas, tensors)}
        partial = directory / f".{SYNC_FILE}.partial"
        save_file(weights, str(partial))
        partial.replace(directory / SYNC_FILE)  # the engine never reads a half-written file
        self.client.update_weights({"model_path": str(directory)})
