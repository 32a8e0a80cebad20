"""Where a prompt's images sit among its tokens, and the rotary positions that follow.

An image stands in the prompt as a run of placeholder tokens, one per embedding the vision
tower makes of it (its merged patches). `expand_placeholders` turns each single placeholder
into that run, once: a run already of the right length (a trainer's own expansion) is kept.
The engine keys cached KV blocks by the images they cover (`ImagePlacement.keys`), and the
runner reads each row's position on the three M-RoPE axes from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hotswap.errors import InvalidArgument


@dataclass(frozen=True, eq=False)
class PlacedImage:
    """One image of a prompt: tokens [offset, offset + length) are its placeholders;
    `pixel_values` its patches [patches, patch_dim] (float32), `grid_thw` their grid."""

    offset: int
    length: int
    content_hash: str
    grid_thw: tuple[int, int, int]
    pixel_values: np.ndarray = field(repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class ImagePlacement:
    """A request's images (in prompt order) and its prompt's rotary positions [3, n];
    a token past the prompt is at its index + `delta` on every axis."""

    images: tuple[PlacedImage, ...]
    prompt_positions: np.ndarray = field(repr=False)
    delta: int

    @classmethod
    def of(cls, images: Sequence[PlacedImage], num_prompt_tokens: int,
           merge_size: int) -> ImagePlacement:  # fmt: skip
        placed = [(image.offset, image.grid_thw) for image in images]
        positions, delta = mrope_positions(num_prompt_tokens, placed, merge_size)
        return cls(tuple(images), positions, delta)

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """Positions [3, end - start] of tokens [start, end)."""
        prompt = self.prompt_positions.shape[1]
        head = self.prompt_positions[:, start : min(end, prompt)]
        if end <= prompt:
            return head
        tail = np.arange(max(start, prompt), end, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)

    def overlapping(self, start: int, end: int) -> list[PlacedImage]:
        return [image for image in self.images if image.offset < end and start < image.end]

    def keys(self, start: int, end: int) -> bytes:
        """What a KV block of tokens [start, end) adds to its hash: the content hashes of
        the images it covers part of (the placeholder tokens alone are all alike)."""
        return b"".join(image.content_hash.encode() for image in self.overlapping(start, end))


def mrope_positions(
    num_tokens: int, images: Sequence[tuple[int, tuple[int, int, int]]], merge: int
) -> tuple[np.ndarray, int]:
    """Rotary positions [3, num_tokens] of a prompt whose images sit at (offset, grid):
    text runs on from the last position; an image's tokens take (t, row, column) from
    there, over its merged grid; the text after it starts past the image's larger side.
    Also the delta every later token adds to its index (transformers' `get_rope_index`)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    index = position = 0
    for offset, (t, h, w) in images:
        h, w = h // merge, w // merge
        out[:, index:offset] = np.arange(position, position + offset - index)
        position += offset - index
        length = t * h * w
        out[:, offset : offset + length] = np.indices((t, h, w)).reshape(3, length) + position
        position += max(h, w)
        index = offset + length
    out[:, index:] = np.arange(position, position + num_tokens - index)
    return out, position - index


def expand_placeholders(
    ids: Sequence[int], token_id: int, lengths: Sequence[int], field_name: str
) -> tuple[list[int], list[int]]:
    """`ids` with the i-th run of placeholder `token_id` made `lengths[i]` long (a run of
    one is expanded; a run already that long is kept), and each run's offset. Refused
    (InvalidArgument naming `field_name`) when the runs and the images do not match."""
    runs = _runs(ids, token_id)
    if len(runs) != len(lengths):
        raise InvalidArgument(field_name, f"{field_name}: {len(lengths)} image(s) given, but "
                              f"the prompt has {len(runs)} image placeholder(s)")  # fmt: skip
    out: list[int] = []
    offsets = []
    last = 0
    for i, ((start, run), length) in enumerate(zip(runs, lengths)):
        if run not in (1, length):
            raise InvalidArgument(field_name, f"{field_name}: image {i}'s placeholder is "
                                  f"{run} tokens long; expected 1 or {length}")  # fmt: skip
        out.extend(ids[last:start])
        offsets.append(len(out))
        out.extend([token_id] * length)
        last = start + run
    out.extend(ids[last:])
    return out, offsets


def _runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
