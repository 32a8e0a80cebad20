"""The m2n plan: the pieces of any trainer sharding and any engine layout reassemble each
engine rank's slice exactly, each byte sent once; malformed shard declarations (overlap,
gap, wrong total, a rank outside the trainer's, mixed dimensions) are refused naming the
shard at fault."""

from __future__ import annotations

import random

import pytest
import torch

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.infos import parse_info
from hotswap.weight_transfer.m2n_plan import (
    M2NInitInfo,
    box,
    plan,
    region_shape,
    relative,
)


def declaration(shapes: list[list[int]], shards: list, trainers: int) -> dict:
    return {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": trainers,
            "world_size": trainers + 2, "names": [f"t{i}" for i in range(len(shapes))],
            "dtype_names": ["float32"] * len(shapes), "shapes": shapes,
            "src_shards": shards}  # fmt: skip


def even(dim: int, size: int, ranks: int) -> list[dict]:
    step = size // ranks
    return [{"rank": r, "dim": dim, "offset": r * step, "length": step} for r in range(ranks)]


@pytest.mark.parametrize("trainers", [1, 2, 4])
@pytest.mark.parametrize("engines", [1, 2, 4])
def test_pieces_rebuild_every_engine_slice_from_the_trainer_shards(trainers, engines) -> None:
    rng = random.Random(trainers * 10 + engines)
    shapes = [[8, 12], [16, 4], [12], [4, 8]]
    shards = [even(0, 8, trainers), even(1, 4, trainers) if 4 % trainers == 0 else None,
              even(0, 12, trainers), None]  # fmt: skip
    info = parse_info(M2NInitInfo, declaration(shapes, shards, trainers), "init_info")
    tensors = [torch.randn(shape) for shape in shapes]
    layouts = []  # engine e's part of each tensor: column-parallel, row-parallel, whole
    for e in range(engines):
        dims = [rng.choice([0, len(shape) - 1]) for shape in shapes]
        layouts.append([(d, e * (shape[d] // engines), shape[d] // engines)
                        if shape[d] % engines == 0 else None
                        for d, shape in zip(dims, shapes, strict=True)])  # fmt: skip
    held = {}  # what each trainer rank holds of each tensor (its box)
    for i, shape in enumerate(shapes):
        for shard in shards[i] or [{"rank": 0}]:
            part = (shard["dim"], shard["offset"], shard["length"]) if shards[i] else None
            held[(i, shard["rank"])] = box(shape, part)
    received = {}
    sent = 0
    for piece in plan(info, list(info.names), layouts):
        source = tensors[piece.index][relative(held[(piece.index, piece.src)],
                                                box(shapes[piece.index], None))]  # fmt: skip
        data = source[relative(piece.region, held[(piece.index, piece.src)])]
        mine = box(shapes[piece.index], layouts[piece.dst][piece.index])
        out = received.setdefault((piece.index, piece.dst), torch.full(region_shape(mine), 99.0))
        out[relative(piece.region, mine)] = data
        sent += data.numel()
    for e, layout in enumerate(layouts):
        for i, tensor in enumerate(tensors):
            want = tensor[relative(box(shapes[i], layout[i]), box(shapes[i], None))]
            assert torch.equal(received[(i, e)], want), (i, e)
    assert sent == sum(received[key].numel() for key in received)  # nothing sent twice


@pytest.mark.parametrize(
    "shards,field,message",
    [
        ([{"rank": 0, "dim": 0, "offset": 0, "length": 5},
          {"rank": 1, "dim": 0, "offset": 4, "length": 4}], "src_shards[0][1].offset", "overlaps"),
        ([{"rank": 0, "dim": 0, "offset": 0, "length": 3},
          {"rank": 1, "dim": 0, "offset": 4, "length": 4}], "src_shards[0][1].offset",
         r"leaves \[3, 4\)"),
        ([{"rank": 0, "dim": 0, "offset": 0, "length": 4},
          {"rank": 1, "dim": 0, "offset": 4, "length": 3}], "src_shards[0]", "cover 7 of dim 0"),
        ([{"rank": 0, "dim": 0, "offset": 0, "length": 4},
          {"rank": 2, "dim": 0, "offset": 4, "length": 4}], "src_shards[0][1].rank",
         "not a trainer rank"),
        ([{"rank": 0, "dim": 0, "offset": 0, "length": 4},
          {"rank": 1, "dim": 1, "offset": 4, "length": 4}], "src_shards[0][1].dim", "one dim"),
        ([{"rank": 0, "dim": 2, "offset": 0, "length": 8}], "src_shards[0][0].dim", "one dim"),
        ([{"rank": 0, "dim": 0, "offset": 0, "length": 4},
          {"rank": 0, "dim": 0, "offset": 4, "length": 4}], "src_shards[0][1].rank", "of its own"),
    ],
)  # fmt: skip
def test_a_malformed_declaration_is_refused_naming_the_shard(shards, field, message) -> None:
    with pytest.raises(InvalidArgument, match=message) as refused:
        parse_info(M2NInitInfo, declaration([[8, 6]], [shards], 2), "init_info")
    assert refused.value.field == f"init_info.{field}"


def test_lists_that_disagree_are_refused_naming_the_list() -> None:
    body = declaration([[8, 6]], [None], 2)
    body["dtype_names"] = []
    with pytest.raises(InvalidArgument) as refused:
        parse_info(M2NInitInfo, body, "init_info")
    assert refused.value.field == "init_info.dtype_names"
