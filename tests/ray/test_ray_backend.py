"""The `ray` weight backend's two halves without a cluster: the engine side stages exactly
the bytes an actor delivered, refusing a chunk that does not match what the update
names; the trainer side refuses a client that cannot carry ObjectRefs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray")

from hotswap.errors import InvalidArgument  # noqa: E402
from hotswap.ray.transfer import (  # noqa: E402
    OBJECT,
    RayObjectEngine,
    RayTrainerInitInfo,
    _host_bytes,
    chunks,
    deliver,
)
from hotswap.weight_transfer import (  # noqa: E402
    HTTPWeightSyncClient,
    TensorSource,
    WeightTransferTrainerFactory,
)
from hotswap.weight_transfer.base import ParamMeta, metas_to_update_info  # noqa: E402

TENSORS = {
    "a": torch.randn(3, 5, dtype=torch.bfloat16),
    "b": torch.tensor([True, False, True]),
    "c": torch.arange(7, dtype=torch.int64).reshape(7, 1),
    "empty": torch.empty(0, 4),
    "d": torch.randn(2, 2).t(),  # not contiguous
}


def metas(tensors: dict[str, torch.Tensor]) -> list[ParamMeta]:
    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def receive(tensors: dict[str, torch.Tensor], arrays: list) -> dict[str, torch.Tensor]:
    engine = RayObjectEngine(torch.device("cpu"))
    info = metas_to_update_info(metas(tensors))
    with deliver(info, arrays) as json_info:
        parsed = engine.parse_update_info(json_info)
        return dict(engine.receive_weights(json_info, parsed))


def test_delivered_bytes_are_staged_exactly() -> None:
    got = receive(TENSORS, [_host_bytes(t) for t in TENSORS.values()])
    for name, tensor in TENSORS.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].view(-1).view(torch.uint8) if tensor.numel() else got[name],
                           tensor.contiguous().view(-1).view(torch.uint8)
                           if tensor.numel() else tensor)  # fmt: skip


def test_a_chunk_that_does_not_match_is_refused_naming_the_tensor() -> None:
    arrays = [_host_bytes(t) for t in TENSORS.values()]
    arrays[2] = arrays[2][:-8]  # one int64 short
    with pytest.raises(InvalidArgument, match=r"update_info\.object\[2\].*48 bytes.*'c'") as e:
        receive(TENSORS, arrays)
    assert e.value.field == "update_info.object[2]"
    with pytest.raises(InvalidArgument, match="holds 4 tensors, the update names 5"):
        receive(TENSORS, arrays[:4])


def test_an_update_with_no_delivered_chunk_is_refused() -> None:
    engine = RayObjectEngine(torch.device("cpu"))
    info = {**metas_to_update_info(metas(TENSORS)), OBJECT: "0123"}
    with pytest.raises(InvalidArgument, match="through a hotswap.ray engine actor"):
        list(engine.receive_weights(info, engine.parse_update_info(info)))


def test_chunks_bound_each_object_and_keep_order() -> None:
    sizes = [ParamMeta(str(i), torch.uint8, (n,)) for i, n in enumerate([40, 30, 100, 10, 10])]
    assert chunks(sizes, 64) == [[0], [1], [2], [3, 4]]  # 100 > 64 travels alone
    assert chunks(sizes, 1000) == [[0, 1, 2, 3, 4]]


def test_the_trainer_refuses_a_client_that_cannot_carry_object_refs() -> None:
    client = HTTPWeightSyncClient("http://127.0.0.1:9")
    with pytest.raises(InvalidArgument, match="only a hotswap.ray client"):
        WeightTransferTrainerFactory.trainer_init(
            RayTrainerInitInfo(), client, TensorSource(list(TENSORS.items()))
        )
    client.close()
