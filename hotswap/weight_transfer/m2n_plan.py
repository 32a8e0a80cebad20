"""The m2n backend's wire infos and its transfer plan (shared by both sides).

M trainer ranks each hold slices of the checkpoint tensors (FSDP-style shards: `src_shards`,
one box per rank along one dimension); N engine ranks each need their tensor-parallel
slice (published by the engine ranks as the group forms). A piece is the intersection of a
trainer rank's box and an engine rank's: trainer rank t sends engine rank e exactly that
box, so no rank ever holds a whole tensor it does not own, and each engine rank receives
only the bytes of its own slices. Both sides compute the same pieces in the same order.

The init info follows vLLM's `nccl_m2n` (`master_address`, `master_port`, `rank_offset`
= the number of trainer ranks, `world_size`, `names`, `dtype_names`, `shapes`), with the
trainer's shards declared by explicit offsets (`src_shards`), so uneven shards are
expressible and overlaps, gaps and wrong totals are refused naming the shard at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.infos import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    Count,
    DTypeName,
    Info,
    Port,
    Rank,
    Shape,
    TensorName,
    WorldSize,
)


class SrcShard(msgspec.Struct, kw_only=True, frozen=True):
    """Trainer rank `rank` holds entries [offset, offset + length) of dimension `dim`."""

    rank: Rank
    dim: Count
    offset: Count
    length: Count


class M2NInitInfo(Info):
    """Engine side: the group (trainer ranks 0..rank_offset-1, engine ranks after them)
    and the tensors every round sends, with the trainer ranks' shards of each (null: the
    tensor is whole on trainer rank 0)."""

    master_address: Annotated[
        str, msgspec.Meta(min_length=1, max_length=255, description="a host name or address")
    ]
    master_port: Port
    world_size: WorldSize
    rank_offset: Rank
    names: list[TensorName]
    dtype_names: list[DTypeName]
    shapes: list[Shape]
    src_shards: list[list[SrcShard] | None]
    timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0, le=MAX_TIMEOUT_S,
                     description=f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]"),
    ] = DEFAULT_TIMEOUT_S  # fmt: skip

    def check(self) -> None:
        if not 1 <= self.rank_offset < self.world_size:
            raise InvalidArgument("rank_offset", f"rank_offset: the number of trainer ranks "
                                  f"must be in [1, {self.world_size - 1}], got "
                                  f"{self.rank_offset}")  # fmt: skip
        count = len(self.names)
        for field in ("dtype_names", "shapes", "src_shards"):
            if len(getattr(self, field)) != count:
                raise InvalidArgument(field, f"{field}: {len(getattr(self, field))} entries "
                                      f"for {count} names")  # fmt: skip
        if len(set(self.names)) != count:
            raise InvalidArgument("names", "names: a tensor is named twice")
        for i, shards in enumerate(self.src_shards):
            if shards is not None:
                check_shards(shards, self.shapes[i], self.rank_offset, f"src_shards[{i}]")


class M2NUpdateInfo(Info):
    """A round: the declared tensors it sends (sent in their declared order)."""

    names: list[TensorName]


def check_shards(shards: list[SrcShard], shape: list[int], trainers: int, field: str) -> None:
    """The shards tile dimension `dim` of `shape` exactly once, each on its own rank."""
    if not shards:
        raise InvalidArgument(field, f"{field}: no shard (null: whole on trainer rank 0)")
    dim = shards[0].dim
    ranks: set[int] = set()
    end = 0
    for j, shard in sorted(enumerate(shards), key=lambda item: item[1].offset):
        at = f"{field}[{j}]"
        if shard.dim != dim or dim >= len(shape):
            raise InvalidArgument(f"{at}.dim", f"{at}.dim: {shard.dim}; every shard of the "
                                  f"tensor splits one dimension of its {len(shape)}")  # fmt: skip
        if shard.rank >= trainers or shard.rank in ranks:
            raise InvalidArgument(f"{at}.rank", f"{at}.rank: {shard.rank} is not a trainer rank "
                                  f"of its own (trainer ranks: 0..{trainers - 1})")  # fmt: skip
        ranks.add(shard.rank)
        if shard.offset < end:
            raise InvalidArgument(f"{at}.offset", f"{at}.offset: {shard.offset} overlaps the "
                                  f"shard before it (which ends at {end})")  # fmt: skip
        if shard.offset > end:
            raise InvalidArgument(f"{at}.offset", f"{at}.offset: {shard.offset} leaves "
                                  f"[{end}, {shard.offset}) of dim {dim} to no shard")  # fmt: skip
        end = shard.offset + shard.length
    if end != shape[dim]:
        raise InvalidArgument(field, f"{field}: the shards cover {end} of dim {dim}, whose "
                              f"size is {shape[dim]}")  # fmt: skip


Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def box(shape: list[int] | tuple[int, ...], part: tuple[int, int, int] | None) -> Box:
    """The entries a (dim, start, size) part of a tensor of `shape` covers (None: all)."""
    bounds = [(0, size) for size in shape]
    if part is not None:
        dim, start, size = part
        bounds[dim] = (start, start + size)
    return tuple(bounds)


def intersect(a: Box, b: Box) -> Box | None:
    bounds = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in bounds) else bounds


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """`inner`'s position inside a tensor holding `outer`'s entries."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


@dataclass(frozen=True)
class Piece:
    """Tensor `index`'s entries `region`, from trainer rank `src` to engine rank `dst`
    (engine ranks counted from 0)."""

    index: int
    src: int
    dst: int
    region: Box


def src_part(shard: SrcShard | None) -> tuple[int, int, int] | None:
    return None if shard is None else (shard.dim, shard.offset, shard.length)


def plan(
    info: M2NInitInfo, names: list[str], layouts: list[list[tuple[int, int, int] | None]]
) -> list[Piece]:
    """Every piece of a round sending `names`, in the order both sides move them.
    `layouts[e][i]`: engine rank e's part of tensor i (size 0: it takes none of it)."""
    index = {name: i for i, name in enumerate(info.names)}
    pieces = []
    for i in sorted(index[name] for name in names):
        shape = info.shapes[i]
        shards = info.src_shards[i] or [SrcShard(rank=0, dim=0, offset=0, length=shape[0]
                                                 if shape else 1)]  # fmt: skip
        sources = [(s.rank, box(shape, src_part(s) if info.src_shards[i] else None))
                   for s in shards]  # fmt: skip
        for dst, layout in enumerate(layouts):
            wanted = box(shape, layout[i])
            for src, held in sources:
                region = intersect(held, wanted)
                if region is not None:
                    pieces.append(Piece(i, src, dst, region))
    return pieces


def region_shape(region: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)
