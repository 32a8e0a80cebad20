"""Packed transfer: the raw bytes of many tensors, back to back, cut into fixed-size
buffers. Both sides derive the buffer boundaries from the same metadata, so a tensor may
span buffers and no per-buffer header is needed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from hotswap.weight_transfer.base import ParamMeta


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def buffer_lengths(metas: Sequence[ParamMeta], buffer_size: int) -> list[int]:
    total = sum(m.nbytes for m in metas)
    full, rest = divmod(total, buffer_size)
    return [buffer_size] * full + ([rest] if rest else [])


def pack(
    tensors: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    before_reuse: Callable[[int], None],
) -> Iterator[tuple[int, int]]:
    """Copy the tensors' bytes into the rotating `buffers`, yielding (buffer index, bytes
    used) as each one fills. `before_reuse(i)` runs before buffer i is written again (wait
    for its previous send), so packing the next buffer overlaps sending this one."""
    size = buffers[0].numel()
    index, offset = 0, 0
    before_reuse(0)
    for tensor in tensors:
        src = byte_view(tensor.contiguous())
        pos = 0
        while pos < src.numel():
            count = min(size - offset, src.numel() - pos)
            buffers[index][offset : offset + count].copy_(src[pos : pos + count])
            offset, pos = offset + count, pos + count
            if offset == size:
                yield index, size
                index, offset = (index + 1) % len(buffers), 0
                before_reuse(index)
    if offset:
        yield index, offset


class Unpacker:
    """Receives the byte stream of `metas` buffer by buffer into freshly allocated tensors."""

    def __init__(
        self,
        metas: Sequence[ParamMeta],
        allocate: Callable[[ParamMeta], torch.Tensor] | None = None,
    ) -> None:
        self.metas = list(metas)
        allocate = allocate or (lambda m: torch.empty(m.shape, dtype=m.dtype))
        self.tensors = [allocate(m) for m in metas]
        self._views = [byte_view(t) for t in self.tensors]
        self._index, self._pos = 0, 0

    def feed(self, data: torch.Tensor) -> None:
        offset = 0
        while offset < data.numel():
            while self._pos == self._views[self._index].numel():
                self._index, self._pos = self._index + 1, 0
            view = self._views[self._index]
            count = min(view.numel() - self._pos, data.numel() - offset)
            view[self._pos : self._pos + count].copy_(data[offset : offset + count])
            self._pos, offset = self._pos + count, offset + count

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(m.name, t) for m, t in zip(self.metas, self.tensors)]
