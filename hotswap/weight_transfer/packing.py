"""Packed transfer: the bytes of many tensors laid out back to back (each at a 16-byte
aligned offset, zero padding between), cut into fixed-size buffers. Both sides derive the
layout and the buffer boundaries from the same metadata, so a tensor may span buffers and
no header travels. The receiver keeps the whole layout in one flat byte tensor and hands
out views of it: nothing is unpacked tensor by tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from hotswap.weight_transfer.base import ParamMeta

ALIGN = 16  # every tensor starts at a multiple of this many bytes (any dtype can view it)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def layout(metas: Sequence[ParamMeta]) -> tuple[list[int], int]:
    """(byte offset of each tensor, total bytes)."""
    offsets, pos = [], 0
    for meta in metas:
        pos += -pos % ALIGN
        offsets.append(pos)
        pos += meta.nbytes
    return offsets, pos


def buffer_lengths(metas: Sequence[ParamMeta], buffer_size: int) -> list[int]:
    total = layout(metas)[1]
    full, rest = divmod(total, buffer_size)
    return [buffer_size] * full + ([rest] if rest else [])


def _stream(tensors: Sequence[torch.Tensor], device: torch.device) -> Iterator[torch.Tensor]:
    """The layout as a sequence of byte pieces: padding, tensor, padding, tensor, ..."""
    pos = 0
    for tensor in tensors:
        pad = -pos % ALIGN
        if pad:
            yield torch.zeros(pad, dtype=torch.uint8, device=device)
        piece = byte_view(tensor.contiguous())
        yield piece if piece.device == device else piece.to(device)
        pos += pad + piece.numel()


def pack(
    tensors: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    before_reuse: Callable[[int], None],
) -> Iterator[tuple[int, int]]:
    """Fill the rotating `buffers` with the layout, one `torch.cat` per buffer, yielding
    (buffer index, bytes used) as each is ready. `before_reuse(i)` runs before buffer i is
    written again (wait for its previous send), so packing overlaps sending."""
    size, device = buffers[0].numel(), buffers[0].device
    index, used, pieces = 0, 0, []
    before_reuse(0)
    for piece in _stream(tensors, device):
        left = piece.numel()
        while left:
            take = min(size - used, left)
            pieces.append(piece if take == left else piece[:take])  # most fit whole
            if take < left:
                piece = piece[take:]
            used, left = used + take, left - take
            if used == size:
                torch.cat(pieces, out=buffers[index])
                yield index, size
                index, used, pieces = (index + 1) % len(buffers), 0, []
                before_reuse(index)
    if used:
        torch.cat(pieces, out=buffers[index][:used])
        yield index, used


def views(metas: Sequence[ParamMeta], data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `metas`, as views of `data` (the received layout)."""
    offsets, _ = layout(metas)
    out = []
    for meta, offset in zip(metas, offsets):
        raw = data[offset : offset + meta.nbytes]
        out.append((meta.name, raw.view(meta.dtype).view(meta.shape)))
    return out


def arena_meta(metas: Sequence[ParamMeta]) -> ParamMeta:
    """How to ask an allocator for a round chunk's receive memory (pooled per chunk)."""
    first = metas[0].name if metas else ""
    return ParamMeta(f"#packed:{first}", torch.uint8, (layout(metas)[1],))
