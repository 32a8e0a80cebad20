"""The backends' typed init and update infos (weight_transfer/infos.py): one declaration per
backend, checked where the verb's arguments are made, refusals named by field path, and
a route's declared wire names for those paths."""

from __future__ import annotations

import pytest

from hotswap.engine.errors import InvalidArgument
from hotswap.engine.verbs import make_args
from hotswap.entrypoints.server.errors import APIError
from hotswap.entrypoints.server.verb_routes import VerbRoute, route_args
from hotswap.errors import InvalidArgument as LeafInvalidArgument
from hotswap.weight_transfer.backends import get_backend
from hotswap.weight_transfer.infos import (
    BroadcastInitInfo,
    IPCInfo,
    NoInitInfo,
    SparseInfo,
    TensorsInfo,
    parse_info,
)

INIT = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}
UPDATE = {"names": ["a", "b"], "dtype_names": ["float32", "torch.bfloat16"],
          "shapes": [[2], [3, 4]]}  # fmt: skip


def test_each_backend_declares_its_infos() -> None:
    declared = {name: (get_backend(name).init_info_cls, get_backend(name).update_info_cls)
                for name in ("gloo", "nccl", "sparse", "ipc")}  # fmt: skip
    assert declared == {
        "gloo": (BroadcastInitInfo, TensorsInfo),
        "nccl": (BroadcastInitInfo, TensorsInfo),
        "sparse": (BroadcastInitInfo, SparseInfo),
        "ipc": (NoInitInfo, IPCInfo),
    }


@pytest.mark.parametrize(
    ("cls", "info", "field"),
    [
        (BroadcastInitInfo, {**INIT, "master_port": 0}, "init_info.master_port"),
        (BroadcastInitInfo, {**INIT, "master_port": "1"}, "init_info.master_port"),
        (BroadcastInitInfo, {**INIT, "timeout_s": float("nan")}, "init_info.timeout_s"),
        (BroadcastInitInfo, {"world_size": 2}, "init_info.master_address"),
        (BroadcastInitInfo, {**INIT, "trainer_rank": 2}, "init_info.trainer_rank"),
        (BroadcastInitInfo, {**INIT, "group_name": "g", "packed": True}, "init_info.packed"),
        (BroadcastInitInfo, [1], "init_info"),
        (TensorsInfo, {**UPDATE, "shapes": [[2], [3, -4]]}, "update_info.shapes[1]"),
        (TensorsInfo, {**UPDATE, "dtype_names": ["float32", "complex64"]},
         "update_info.dtype_names[1]"),
        (TensorsInfo, {**UPDATE, "names": ["a", ""]}, "update_info.names[1]"),
        (TensorsInfo, {**UPDATE, "names": ["a", "a"]}, "update_info.names"),
        (TensorsInfo, {**UPDATE, "shapes": [[2]]}, "update_info"),
        (SparseInfo, {**UPDATE, "nnz": [2, 13]}, "update_info.nnz[1]"),
        (SparseInfo, UPDATE, "update_info.nnz"),
        (IPCInfo, {**UPDATE, "segments": ["s"], "placements": [[0, 0], [1, 8]]},
         "update_info.placements[1]"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_path(cls, info, field) -> None:
    with pytest.raises(LeafInvalidArgument) as refused:
        parse_info(cls, info, field.split(".")[0])
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: "), refused.value


def test_unknown_keys_travel_on_and_defaults_follow_the_layout() -> None:
    info = parse_info(BroadcastInitInfo, {**INIT, "extra": 1}, "init_info")
    assert (info.rank, info.is_packed) == (1, True)
    trl = parse_info(BroadcastInitInfo, {**INIT, "trainer_rank": 1, "packed": False}, "init_info")
    assert (trl.rank, trl.is_packed) == (0, False)
    args = make_args("init_weight_transfer_engine", {"init_info": {**INIT, "extra": 1}},
                     backend="gloo")  # fmt: skip
    assert args.init_info == {**INIT, "extra": 1}  # as sent: the engine's backend reads it


def test_make_args_checks_an_info_as_the_backends() -> None:
    bad = {"init_info": {**INIT, "master_port": 70000}}
    make_args("init_weight_transfer_engine", bad)  # no backend: the engine checks it
    with pytest.raises(InvalidArgument) as refused:
        make_args("init_weight_transfer_engine", bad, backend="gloo")
    assert refused.value.field == "init_info.master_port"
    make_args("init_weight_transfer_engine", bad, backend="ipc")  # ipc reads no init info
    with pytest.raises(InvalidArgument) as refused:
        make_args("update_weights", {"update_info": UPDATE}, backend="sparse")
    assert refused.value.field == "update_info.nnz"


def test_a_route_names_nested_fields_as_declared() -> None:
    route = VerbRoute(
        "/x",
        "init_weight_transfer_engine",
        names={"port": "init_info.master_port", "master_address": "init_info.master_address",
               "world_size": "init_info.world_size"},
        sources={"init_info": "body_as_a_whole"},
    )  # fmt: skip
    wire = {"port": 0, "master_address": "h", "world_size": 2}
    with pytest.raises(APIError) as refused:
        route_args(route, wire, "gloo")
    assert refused.value.param == "body.port"
    assert refused.value.message.startswith("port: must be an integer in [1, 65535]")
    args = route_args(route, {**wire, "port": 1}, "gloo")
    assert args.init_info == {"master_port": 1, "master_address": "h", "world_size": 2}
    with pytest.raises(APIError) as refused:
        route_args(route, {**wire, "port": 1, "world_size": 1}, "gloo")
    assert refused.value.param == "body.world_size"
