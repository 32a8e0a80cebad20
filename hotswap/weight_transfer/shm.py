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
import stat
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hotswap.errors import InvalidArgument

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")  # no "." / "..", no paths


def check_available() -> None:
    if not SHM_DIR.is_dir():
        raise ValueError("ipc: needs POSIX shared memory under /dev/shm (Linux)")


def check_name(name: object, field_name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(
            field_name, f"{field_name}: not a shared-memory segment name: {name!r}"
        )
    return name


def _map(fd: int, size: int) -> mmap.mmap | None:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED) if size else None


@dataclass(eq=False)
class Segment:
    """A segment this process created (`create`) or opened (`attach`)."""

    name: str
    mapping: mmap.mmap | None  # None for an empty segment
    inode: int
    owned: bool
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.data = self.view(torch.uint8, 0, self.size)  # the whole segment

    @property
    def size(self) -> int:
        return len(self.mapping) if self.mapping is not None else 0

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        """`count` elements at byte `offset`, as a tensor with a storage of its own (so
        several such tensors are separate storages to torch.save and safetensors); it
        keeps the mapping alive."""
        if self.mapping is None or count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.mapping, dtype=dtype, count=count, offset=offset)

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    @classmethod
    def create(cls, size: int, prefix: str = "hotswap") -> Segment:
        """A new zero-filled segment, unlinked when this object is collected (or at exit)."""
        check_available()
        name = f"{prefix}_{secrets.token_hex(8)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if size:
                # Reserve the pages now: a full /dev/shm then fails here with ENOSPC
                # instead of killing the process with SIGBUS at the first write.
                os.posix_fallocate(fd, 0, size)
            mapping, inode = _map(fd, size), os.fstat(fd).st_ino
        except OSError as e:
            path.unlink()
            raise ValueError(
                f"shared memory: cannot allocate {size} bytes in {SHM_DIR} ({e})"
            ) from e
        finally:
            os.close(fd)
        segment = cls(name, mapping, inode, owned=True)
        segment._finalizer = weakref.finalize(segment, _unlink, path, os.getpid())
        return segment

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map another process's segment (never created here: a missing name is an error).
        Only a regular file on the shared-memory filesystem itself: the name is opened
        without following a symlink (one in /dev/shm could point at any file this process
        can read, whose bytes would then be taken as weights), and a FIFO or device never
        blocks the open."""
        check_available()
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(SHM_DIR / name, flags)
        except FileNotFoundError:
            raise ValueError(f"no shared-memory segment {name!r}") from None
        except OSError as e:  # ELOOP: a symlink; EISDIR: a directory; EACCES, ...
            raise ValueError(f"{name!r} is not a shared-memory segment ({e.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_dev != os.stat(SHM_DIR).st_dev:
                raise ValueError(f"{name!r} is not a shared-memory segment")
            return cls(name, _map(fd, info.st_size), info.st_ino, owned=False)
        finally:
            os.close(fd)

    def is_current(self) -> bool:
        """Whether the name still refers to the segment mapped here, at the same size."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return info.st_ino == self.inode and info.st_size == self.size

    def unlink(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


def _unlink(path: Path, creator_pid: int) -> None:
    if os.getpid() != creator_pid:
        return  # a forked child: the segment is its parent's to remove
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
