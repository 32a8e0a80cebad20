"""Sparse delta patches over the broadcast group: only changed elements travel, the
result equals the fully updated model, and bad patches change nothing."""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    SparsePatch,
    SparseTrainerInitInfo,
    WeightTransferTrainerFactory,
    diff_patches,
)
from hotswap.weight_transfer.base import ModuleSource
from tests.weight_transfer.conftest import free_port


def sparse_llm(path, double_buffer: bool = False) -> LLM:  # noqa: ANN001
    return LLM(str(path), dtype="float32", progress=False,
               weight_transfer_config={"backend": "sparse",
                                       "double_buffer": double_buffer})  # fmt: skip


def trainer(llm: LLM):  # noqa: ANN201
    info = SparseTrainerInitInfo(
        master_port=free_port(), world_size=2, packed_buffer_size_bytes=4096
    )
    return WeightTransferTrainerFactory.trainer_init(info, InProcessWeightSyncClient(llm), None)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_patches_reach_the_same_weights_as_a_full_update(double_buffer, v1_dir, v1_trainer) -> None:
    before = {name: tensor.clone() for name, tensor in ModuleSource(v1_trainer)}
    gen = torch.Generator().manual_seed(0)
    after = {}
    for name, tensor in before.items():
        mask = torch.rand(tensor.shape, generator=gen) < 0.01
        after[name] = torch.where(mask, tensor + 1.0, tensor)
    patches = diff_patches(before, after)
    sent = sum(p.indices.numel() for p in patches)
    total = sum(t.numel() for t in before.values())
    assert 0 < sent < 0.02 * total
    llm = sparse_llm(v1_dir, double_buffer)
    trainer(llm).send_patches(patches, "patched")
    assert llm.get_weight_info()["label"] == "patched"
    reference = sparse_llm(v1_dir)
    reference.engine.runner.model.load_weights(after.items())
    assert llm.get_weight_info()["digest"] == reference.get_weight_info()["digest"]


def test_empty_patch_list_is_a_no_op_and_bad_patches_change_nothing(v1_dir) -> None:
    llm = sparse_llm(v1_dir)
    engine = trainer(llm)
    engine.send_patches([], "nothing")
    before = llm.get_weight_info()
    assert before["version"] == 0
    shape = (64,)
    bad_index = SparsePatch("model.norm.weight", shape, torch.tensor([3, 64]), torch.ones(2))
    with pytest.raises(ValueError, match="outside"):
        engine.send_patches([bad_index])
    unknown = SparsePatch("model.bogus.weight", shape, torch.tensor([0]), torch.ones(1))
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.send_patches([unknown])
    assert llm.get_weight_info() == before
    good = SparsePatch("model.norm.weight", shape, torch.tensor([0, 5]), torch.tensor([2.0, 3.0]))
    engine.send_patches([good], "good")
    norm = llm.engine.runner.model.parameter_index()["model.norm.weight"]
    assert norm[0] == 2.0 and norm[5] == 3.0
    with pytest.raises(TypeError, match="send_patches"):
        engine.send_weights()
    with pytest.raises(ValueError, match="2 indices but 1 values"):
        SparsePatch("x", (4,), torch.tensor([0, 1]), torch.ones(1))
