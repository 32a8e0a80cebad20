"""The `ipc` backend's zero-copy paths: a trainer whose parameters live in shared memory
sends them in place (no staging), keeps training in place and sends again; tensors that
left shared memory are staged; bad placements are refused naming the field, model unchanged;
the engine drops mappings of segments a round no longer uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hotswap import LLM
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from hotswap.weight_transfer.ipc import _locate, share_module_memory
from hotswap.weight_transfer.shm import Segment
from tests.weight_transfer.conftest import trainer_model

NORM = "model.norm.weight"


class RecordingClient(InProcessWeightSyncClient):
    def __init__(self, llm: LLM) -> None:
        super().__init__(llm)
        self.updates: list[dict[str, Any]] = []

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.updates.append(update_info)
        super().update_weights(update_info)


def make_llm(path: Path) -> LLM:
    config = {"backend": "ipc", "require_complete": True}
    return LLM(str(path), dtype="float32", progress=False, weight_transfer_config=config)


def digest(path: Path) -> str:
    return LLM(str(path), dtype="float32", progress=False).get_weight_info()["digest"]


def engine_params(llm: LLM) -> dict[str, torch.Tensor]:
    return llm.engine.runner.model.parameter_index()


@pytest.mark.slow
def test_shared_source_is_sent_in_place_and_tracks_training(v1_dir, v2_dir) -> None:
    llm, trainer = make_llm(v1_dir), trainer_model(v2_dir)
    client = RecordingClient(llm)
    info = IPCTrainerInitInfo(share_source=True)
    engine = WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(trainer))
    assert all(_locate(p) is not None for p in trainer.parameters())
    engine.send_weights("v2")
    assert llm.get_weight_info()["digest"] == digest(v2_dir)
    assert len(client.updates) == 1 and len(client.updates[0]["segments"]) == 1
    assert engine.staging == []  # nothing was packed
    with torch.no_grad():  # an optimizer step: in place, so the parameters stay shared
        for param in trainer.parameters():
            param.mul_(1.5)
    engine.send_weights("v2-trained")
    assert torch.equal(engine_params(llm)[NORM], trainer.model.norm.weight.detach())
    assert all(_locate(p) is not None for p in trainer.parameters())


@pytest.mark.slow
def test_parameters_that_left_shared_memory_are_staged(v1_dir, v2_dir) -> None:
    llm, trainer = make_llm(v1_dir), trainer_model(v2_dir)
    assert share_module_memory(trainer) is not None
    trainer.model.norm.weight.data = trainer.model.norm.weight.detach().clone() + 1
    client = RecordingClient(llm)
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), client, ModuleSource(trainer)
    )
    engine.send_weights("mixed")
    staged = [u for u in client.updates if NORM in u["names"]]
    assert len(client.updates) == 2 and staged[0]["names"] == [NORM]
    assert torch.equal(engine_params(llm)[NORM], trainer.model.norm.weight.detach())
    # Sharing again moves only the parameter that left.
    segment = share_module_memory(trainer)
    assert segment is not None and segment.size == trainer.model.norm.weight.nbytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "error"),
    [
        ([0, 2], r"placements\[0\]: offset 2 is not aligned"),
        ([1, 0], r"placements\[0\]: segment index 1, but 1 segment"),
        ([0, 256], r"placements\[0\]: 'model.norm.weight' needs bytes 256..512"),
        (["0", 0], r"placements\[0\]: must be \[segment index, byte offset\]"),
    ],
)
def test_bad_placements_are_refused(v1_dir, placement: list, error: str) -> None:
    llm = make_llm(v1_dir)
    before = llm.get_weight_info()
    segment = Segment.create(300)
    info = {"names": [NORM], "dtype_names": ["float32"], "shapes": [[64]]}
    llm.start_weight_update()
    with pytest.raises(ValueError, match=error):
        llm.update_weights({**info, "segments": [segment.name], "placements": [placement]})
    with pytest.raises(ValueError, match=r"placements: required, one \[segment, byte offset\]"):
        llm.update_weights({**info, "segments": [segment.name], "placements": []})
    with pytest.raises(ValueError, match=r"segments\[0\]: not a shared-memory segment name"):
        llm.update_weights({**info, "segments": ["../etc/passwd"], "placements": [[0, 0]]})
    llm.finish_weight_update(abort=True)
    assert llm.get_weight_info() == before


def _mappings(name: str) -> int:
    return Path("/proc/self/maps").read_text().count(f"/dev/shm/{name}")


@pytest.mark.slow
def test_engine_drops_mappings_a_round_no_longer_uses(v1_dir, v2_dir) -> None:
    llm, trainer = make_llm(v1_dir), trainer_model(v2_dir)
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), InProcessWeightSyncClient(llm), ModuleSource(trainer)
    )
    engine.send_weights("staged")
    staging = engine.staging[0].name
    assert _mappings(staging) == 2  # the trainer's and the engine's (kept for next round)
    share_module_memory(trainer)
    engine.send_weights("in place")  # the staging segment is not used this round
    assert _mappings(staging) == 1  # only the trainer's own
    assert llm.get_weight_info()["digest"] == digest(v2_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"handle": "not base64!"}, r"cuda_ipc\[0\].handle: not valid base64"),
        ({"storage_size": -1}, r"cuda_ipc\[0\].storage_size: must be a non-negative integer"),
        ({"stride": [1, 1]}, r"cuda_ipc\[0\].stride: one integer per dimension of \[64\]"),
        ({"storage_size": 16}, r"cuda_ipc\[0\].storage_size: 16 bytes do not hold the view"),
        ({"event_sync_required": "yes"}, r"cuda_ipc\[0\].event_sync_required: must be a boolean"),
        ({"device_uuid": "GPU-x"}, r"cuda_ipc\[0\].device_uuid: "),
    ],
)
def test_cuda_ipc_handles_are_checked_before_opening(v1_dir, change: dict, error: str) -> None:
    llm = make_llm(v1_dir)
    before = llm.get_weight_info()
    handle = {
        "device_uuid": "GPU-x",
        "handle": "AAAA",
        "storage_size": 256,
        "storage_offset": 0,
        "ref_counter_handle": None,
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": False,
        "tensor_offset": 0,
        "stride": [1],
    }
    info = {"names": [NORM], "dtype_names": ["float32"], "shapes": [[64]]}
    llm.start_weight_update()
    with pytest.raises(ValueError, match=error):
        llm.update_weights({**info, "cuda_ipc": [{**handle, **change}]})
    with pytest.raises(ValueError, match=r"cuda_ipc: required, one handle per name \(1\)"):
        llm.update_weights({**info, "cuda_ipc": []})
    llm.finish_weight_update(abort=True)
    assert llm.get_weight_info() == before


def test_shared_parameters_still_checkpoint(tmp_path: Path) -> None:
    import io

    from safetensors.torch import load_model, save_model

    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    module[1].to(torch.bfloat16)  # mixed dtypes in one segment
    expected = {k: v.clone() for k, v in module.state_dict().items()}
    assert share_module_memory(module) is not None
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    save_model(module, str(tmp_path / "m.safetensors"))
    copy = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    load_model(copy, str(tmp_path / "m.safetensors"))
    assert all(torch.equal(copy.state_dict()[k], v) for k, v in expected.items())


def test_a_handle_exported_by_this_process_is_taken_as_is() -> None:
    # CUDA cannot open an IPC handle in the process that exported it; an in-process engine
    # takes the exported tensor itself (CPU tensors stand in for CUDA ones here).
    import os

    from hotswap.weight_transfer import cuda_ipc
    from hotswap.weight_transfer.base import ParamMeta

    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    cuda_ipc._EXPORTED[10**9] = tensor
    entry = {"pid": os.getpid(), "export_id": 10**9}
    meta = ParamMeta("w", torch.float32, (2, 3))
    assert cuda_ipc.open_handle(meta, entry, "f") is tensor
    with pytest.raises(ValueError, match="the exported tensor is not w"):
        cuda_ipc.open_handle(ParamMeta("w", torch.float32, (3, 2)), entry, "f")
    with pytest.raises(ValueError, match="f.handle"):  # another process's: a real handle needed
        cuda_ipc.open_handle(meta, {**entry, "pid": os.getpid() + 1, "handle": 5}, "f")
