"""Named shared-memory segments (POSIX shm under /dev/shm) seen as flat uint8 tensors.

A segment is a file in /dev/shm mapped with MAP_SHARED; its tensor owns the mapping, which
is unmapped when the last view of it is garbage collected. (Python's
`multiprocessing.shared_memory` refuses to close a mapping that tensors still view, so it
cannot back tensors that live as long as a model's parameters.) Unlinking a segment
removes its name; mappings made before stay valid until their views die."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def check_available() -> None:
    if not SHM_DIR.is_dir():
        raise ValueError("ipc: needs POSIX shared memory under /dev/shm (Linux)")


def check_name(name: object, field_name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{field_name}: not a shared-memory segment name: {name!r}")
    return name


def _map(fd: int, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps `mapping` alive


@dataclass
class Segment:
    """A segment this process created (`create`) or opened (`attach`)."""

    name: str
    data: torch.Tensor  # the whole segment, as uint8
    inode: int
    owned: bool
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.data.numel()

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    @classmethod
    def create(cls, size: int, prefix: str = "hotswap") -> Segment:
        """A new zero-filled segment, unlinked when this object is collected (or at exit)."""
        check_available()
        name = f"{prefix}_{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            data, inode = _map(fd, size), os.fstat(fd).st_ino
        finally:
            os.close(fd)
        segment = cls(name, data, inode, owned=True)
        segment._finalizer = weakref.finalize(segment, _unlink, SHM_DIR / name)
        return segment

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map another process's segment (never created here: a missing name is an error)."""
        check_available()
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(f"no shared-memory segment {name!r}") from None
        try:
            stat = os.fstat(fd)
            return cls(name, _map(fd, stat.st_size), stat.st_ino, owned=False)
        finally:
            os.close(fd)

    def is_current(self) -> bool:
        """Whether the name still refers to the segment mapped here, at the same size."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        return stat.st_ino == self.inode and stat.st_size == self.size

    def unlink(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
