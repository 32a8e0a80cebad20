"""Sources, update-info parsing and packing: the pieces both sides of a transfer share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hotswap.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    TensorSource,
    checked_items,
    metas_from_update_info,
    metas_to_update_info,
)
from hotswap.weight_transfer.packing import ALIGN, buffer_lengths, layout, pack, views


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=gen)),
        ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("empty", torch.empty(0, 4)),
        ("c", torch.randint(0, 100, (11,), generator=gen)),
        ("big", torch.randn(64, 33, generator=gen)),  # larger than the buffers below
        ("flag", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5, dtype=torch.float16)),
    ]


@pytest.mark.parametrize("buffer_size,num_buffers", [(1, 1), (13, 2), (1000, 3), (1 << 20, 2)])
def test_pack_then_view_round_trip(buffer_size: int, num_buffers: int) -> None:
    items = mixed_tensors()
    metas = [ParamMeta.of(n, t) for n, t in items]
    buffers = [torch.empty(buffer_size, dtype=torch.uint8) for _ in range(num_buffers)]
    received = []
    for index, used in pack([t for _, t in items], buffers, lambda i: None):
        received.append(buffers[index][:used].clone())
    assert [r.numel() for r in received] == buffer_lengths(metas, buffer_size)
    data = torch.cat(received)
    assert data.numel() == layout(metas)[1]
    for (name, tensor), (got_name, got) in zip(items, views(metas, data)):
        assert got_name == name and got.dtype == tensor.dtype and torch.equal(got, tensor)


def test_layout_aligns_every_tensor() -> None:
    metas = [ParamMeta.of(n, t) for n, t in mixed_tensors()]
    offsets, total = layout(metas)
    assert all(offset % ALIGN == 0 for offset in offsets)
    assert total == offsets[-1] + metas[-1].nbytes


def test_empty_source_packs_nothing() -> None:
    buffers = [torch.empty(8, dtype=torch.uint8)]
    assert list(pack([], buffers, lambda i: None)) == []
    assert buffer_lengths([], 8) == []
    assert views([], torch.empty(0, dtype=torch.uint8)) == []


def test_update_info_round_trip_and_errors() -> None:
    metas = [ParamMeta.of(n, t) for n, t in mixed_tensors()]
    assert metas_from_update_info(metas_to_update_info(metas)) == metas
    good = metas_to_update_info(metas)
    cases = [
        ({**good, "shapes": good["shapes"][:-1]}, "differ in length"),
        ({**good, "dtype_names": ["float32"] * 6 + ["complex64"]}, r"dtype_names\[6\]"),
        ({**good, "shapes": [[-1]] + good["shapes"][1:]}, r"shapes\[0\]"),
        ({**good, "names": ["a"] * 7}, "appears twice"),
        ({"names": ["a"], "dtype_names": ["float32"]}, "update_info.shapes"),
        ([], "JSON object"),
    ]
    for info, message in cases:
        with pytest.raises(ValueError, match=message):
            metas_from_update_info(info)


class Disagreeing(TensorSource):
    def __init__(self, tensors, metas) -> None:  # noqa: ANN001
        super().__init__(tensors)
        self._metas = metas

    def metadata(self) -> list[ParamMeta]:
        return self._metas


def test_source_channels_must_agree_naming_the_first_mismatch() -> None:
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    metas, tensors = checked_items(ModuleSource(module))
    assert [m.name for m in metas] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(t.data_ptr() == p.data_ptr() for t, p in zip(tensors, module.parameters()))
    items = list(ModuleSource(module))
    wrong_shape = [*metas[:2], ParamMeta("1.weight", torch.float32, (2, 4)), metas[3]]
    with pytest.raises(ValueError, match=r"element 2 disagrees.*1\.weight"):
        checked_items(Disagreeing(items, wrong_shape))
    wrong_dtype = [ParamMeta("0.weight", torch.bfloat16, (3, 4)), *metas[1:]]
    with pytest.raises(ValueError, match="element 0 disagrees"):
        checked_items(Disagreeing(items, wrong_dtype))
    with pytest.raises(ValueError, match="more tensors than metadata"):
        checked_items(Disagreeing(items, metas[:3]))
    with pytest.raises(ValueError, match="first missing: '1.bias'"):
        checked_items(Disagreeing(items[:3], metas))
