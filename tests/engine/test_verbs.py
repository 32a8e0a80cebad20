"""The control-verb table: every verb has one handler, its arguments are validated once
with the field named, only declared verbs cross the wire, and data-parallel answers merge
as each verb declares."""

from __future__ import annotations

import typing

import msgspec
import pytest

from hotswap.engine import verbs
from hotswap.engine.core import HANDLERS
from hotswap.engine.core_loop import InputKind
from hotswap.engine.dp_client import _merge
from hotswap.engine.messages import CallError, UtilityCall, UtilityResult
from hotswap.engine.wire import decode_input, encode_input
from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.dtypes import DTYPES as _DTYPES


def test_every_verb_has_exactly_one_handler() -> None:
    assert set(HANDLERS) == set(verbs.VERBS)


# One tensor by value, as JSON sends it (data: base64 of 8 raw bytes).
TENSOR = {"name": "w", "dtype": "float32", "shape": [2], "data": "AAAAAAAAAAA="}


@pytest.mark.parametrize(
    ("verb", "values", "field"),
    [
        ("pause", {"mode": "nap"}, "mode"),
        ("pause", {"mode": ["abort"]}, "mode"),
        ("pause", {"clear_cache": "yes"}, "clear_cache"),
        ("pause", {"clear_cache": 1}, "clear_cache"),
        ("sleep", {"level": 3}, "level"),
        ("sleep", {"level": True}, "level"),
        ("wake_up", {"tags": ["weights", "gpu"]}, "tags"),
        ("wake_up", {"tags": "weights"}, "tags"),
        ("load_weights_from_disk", {}, "model_path"),
        ("load_weights_from_disk", {"model_path": "x" * 5000}, "model_path"),
        ("load_weights_from_disk", {"model_path": "/m", "weight_version": ""}, "weight_version"),
        ("finish_weight_update", {"abort": "true"}, "abort"),
        ("finish_weight_update", {"weight_version": "v" * 300}, "weight_version"),
        ("update_weight_version", {}, "label"),
        ("update_weight_version", {"label": 3}, "label"),
        ("init_weight_transfer_engine", {"init_info": [1]}, "init_info"),
        ("update_weights", {"update_info": "x"}, "update_info"),
        ("reset_prefix_cache", {"reset_running_requests": None}, "reset_running_requests"),
        ("load_weights_inline", {}, "tensors"),
        ("load_weights_inline", {"tensors": []}, "tensors"),
        ("load_weights_inline", {"tensors": [TENSOR, 3]}, "tensors"),
        ("load_weights_inline", {"tensors": [TENSOR, {**TENSOR, "data": "%%"}]}, "tensors[1].data"),
        ("load_weights_inline", {"tensors": [{**TENSOR, "data": 5}]}, "tensors[0].data"),
        ("load_weights_inline", {"tensors": [{**TENSOR, "dtype": "float8"}]}, "tensors[0].dtype"),
        ("load_weights_inline", {"tensors": [{**TENSOR, "shape": [2, -1]}]}, "tensors[0].shape"),
        ("load_weights_inline", {"tensors": [{**TENSOR, "shape": [True]}]}, "tensors[0].shape"),
        ("load_weights_inline", {"tensors": [{**TENSOR, "shape": [1] * 17}]}, "tensors[0].shape"),
        ("load_weights_inline", {"tensors": [{**TENSOR, "name": ""}]}, "tensors[0].name"),
        (
            "load_weights_inline",
            {"tensors": [{"name": "w", "dtype": "float32", "shape": [2]}]},
            "tensors[0].data",
        ),
        ("load_weights_inline", {"tensors": [{**TENSOR, "device": "cuda"}]}, "tensors[0].device"),
        ("load_weights_inline", {"tensors": [TENSOR], "weight_version": ""}, "weight_version"),
        ("collective_rpc", {"method": ""}, "method"),
        ("collective_rpc", {"method": "m", "kwargs": []}, "kwargs"),
        ("resume", {"now": True}, "now"),
        ("no_such_verb", {}, "method"),
    ],
)
def test_bad_arguments_name_their_field(verb: str, values: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        verbs.make_args(verb, values)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}:")


def test_query_strings_are_read_laxly_and_bodies_strictly() -> None:
    assert verbs.make_args("pause", {"clear_cache": "false"}, lax=True).clear_cache is False
    assert verbs.make_args("sleep", {"level": "2"}, lax=True).level == 2
    with pytest.raises(InvalidArgument):
        verbs.make_args("pause", {"clear_cache": "false"})


def test_only_declared_verbs_cross_the_wire() -> None:
    call = UtilityCall(7, verbs.make_args("pause", {"mode": "keep", "clear_cache": False}))
    kind, decoded = decode_input(encode_input(InputKind.UTILITY, call))
    assert kind == InputKind.UTILITY and decoded == call and decoded.verb == "pause"
    forged = msgspec.msgpack.encode({"call_id": 1, "args": {"type": "shutdown_host"}})
    with pytest.raises(msgspec.ValidationError):
        decode_input([bytes([InputKind.UTILITY]), forged])


def test_tensors_by_value_cross_the_wire_as_bytes() -> None:
    """Base64 is decoded where the call enters; the engine core receives the bytes."""
    args = verbs.make_args("load_weights_inline", {"tensors": [TENSOR], "weight_version": "v"})
    assert args.tensors[0].data == bytes(8)
    frames = encode_input(InputKind.UTILITY, UtilityCall(3, args))
    assert b"AAAAAAAAAAA=" not in frames[1]
    _, decoded = decode_input(frames)
    assert decoded.args == args and isinstance(decoded.args.tensors[0].data, bytes)
    # From Python, bytes are taken as they are.
    raw = verbs.make_args("load_weights_inline", {"tensors": [{**TENSOR, "data": b"\1" * 8}]})
    assert raw.tensors[0].data == b"\1" * 8


def test_tensors_by_value_take_every_transferable_dtype() -> None:
    assert set(typing.get_args(verbs.TensorDType)) == set(_DTYPES)


def _results(values: list) -> list[UtilityResult]:
    return [UtilityResult(1, result=v) for v in values]


def test_data_parallel_answers_merge_as_each_verb_declares() -> None:
    assert _merge(verbs.GetWorldSize, _results([1, 1, 1])).result == 3
    assert _merge(verbs.ResetPrefixCache, _results([4, 0])).result == 4
    assert _merge(verbs.IsPaused, _results([False, True])).result is True
    assert _merge(verbs.WeightUpdateActive, _results([False, False])).result is False
    assert _merge(verbs.CollectiveRpc, _results([["a"], ["b"]])).result == ["a", "b"]
    same = {"version": 2, "label": "s", "digest": "d"}
    assert _merge(verbs.GetWeightInfo, _results([same, same])).result == same
    split = _merge(verbs.FinishWeightUpdate, _results([same, {**same, "digest": "e"}])).result
    assert split["digest"] is None and split["rank_digests"] == ["d", "e"]
    sums = [{**same, "checksums": {"dp0:w": "1"}}, {**same, "checksums": {"dp1:w": "1"}}]
    assert _merge(verbs.FinishWeightUpdate, _results(sums)).result["checksums"] == {
        "dp0:w": "1", "dp1:w": "1"}  # fmt: skip
    stats = _merge(
        verbs.GetStats,
        _results(
            [{"num_running": 2, "weight_version": 1}, {"num_running": 3, "weight_version": 2}]
        ),
    ).result
    assert stats["num_running"] == 5 and stats["weight_version"] == 2
    assert _merge(verbs.Pause, _results([None, None])).result is None


def test_a_rank_refusal_keeps_its_kind_and_field() -> None:
    refused = UtilityResult(1, error=CallError("invalid", "mode: bad", "mode"))
    merged = _merge(verbs.Pause, [UtilityResult(1, result=None), refused])
    assert merged.error == CallError("invalid", "rank 1: mode: bad", "mode")
