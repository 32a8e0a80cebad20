"""Refused weight updates change nothing: clear errors, the model (digest) untouched, and the
next good round succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hotswap import LLM
from hotswap.engine.errors import EngineStateError
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    TensorSource,
    WeightTransferTrainerFactory,
)
from hotswap.weight_transfer.base import ParamMeta
from tests.weight_transfer.conftest import free_port

# Engines in this process, one or more per test (gloo groups among them): slow.
pytestmark = pytest.mark.slow

NORM = "model.norm.weight"


def make_llm(path: Path, backend: str = "ipc", **kw) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        progress=False,
        weight_transfer_config={"backend": backend, **kw},
    )


def send(llm: LLM, items: list[tuple[str, torch.Tensor]], backend: str = "ipc") -> None:
    info = (
        IPCTrainerInitInfo()
        if backend == "ipc"
        else GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=20)
    )
    WeightTransferTrainerFactory.trainer_init(
        info, InProcessWeightSyncClient(llm), TensorSource(items)
    ).send_weights("bad")


@pytest.mark.parametrize("backend", ["ipc", "gloo"])
@pytest.mark.parametrize(
    "items,message",
    [
        ([("model.layers.0.mlp.bogus.weight", torch.zeros(3))], "unknown parameter"),
        ([(NORM, torch.zeros(63))], "shape mismatch"),
        ([(NORM, torch.zeros(64, dtype=torch.int64))], "dtype mismatch"),
        ([(NORM, torch.ones(64)), ("lm_head.weight", torch.zeros(2, 2))], "shape mismatch"),
    ],
)
def test_refused_update_changes_nothing(backend, items, message, v1_dir, v2_trainer) -> None:
    llm = make_llm(v1_dir, backend)
    before = llm.get_weight_info()
    with pytest.raises(ValueError, match=message):
        send(llm, items, backend)
    assert llm.get_weight_info() == before
    assert not llm.engine.weight_sync.round_open  # the trainer aborted the round
    good = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo() if backend == "ipc" else GlooTrainerInitInfo(
            master_port=free_port(), world_size=2
        ),
        InProcessWeightSyncClient(llm),
        ModuleSource(v2_trainer),
    )  # fmt: skip
    good.send_weights("good")
    assert llm.get_weight_info()["version"] == before["version"] + 1


def test_phase_order_is_enforced(v1_dir) -> None:
    llm = make_llm(v1_dir)
    info = {"names": [NORM], "dtype_names": ["float32"], "shapes": [[64]]}
    info |= {"segments": ["x"], "placements": [[0, 0]]}
    with pytest.raises(EngineStateError, match="no round is open"):
        llm.update_weights(info)
    with pytest.raises(EngineStateError, match="no round is open"):
        llm.finish_weight_update()
    llm.start_weight_update()
    with pytest.raises(EngineStateError, match="already open"):
        llm.start_weight_update()
    with pytest.raises(EngineStateError, match="round is open"):
        llm.generate(["no step while a round is open"])
    bad_lengths = {"names": [NORM, "x"], "dtype_names": ["float32"], "shapes": [[64]]}
    with pytest.raises(ValueError, match="differ in length"):
        llm.update_weights(bad_lengths)
    with pytest.raises(ValueError, match=r"segments\[0\]: no shared-memory segment 'x'"):
        llm.update_weights(info)
    with pytest.raises(ValueError, match="is_checkpoint_format"):
        make_llm(v1_dir).start_weight_update("yes")
    llm.finish_weight_update(abort=True)
    assert llm.get_weight_info()["version"] == 0
    assert llm.generate(["runs again"], use_tqdm=False)[0].finished


def test_require_complete_refuses_partial_rounds(v1_dir, v2_trainer) -> None:
    llm = make_llm(v1_dir, require_complete=True)
    before = llm.get_weight_info()
    with pytest.raises(ValueError, match="does not cover every weight"):
        send(llm, [(NORM, torch.ones(64))])
    assert llm.get_weight_info() == before


def test_not_configured_and_gloo_needs_init(v1_dir) -> None:
    plain = LLM(str(v1_dir), dtype="float32", progress=False)
    with pytest.raises(EngineStateError, match="not configured"):
        plain.start_weight_update()
    with pytest.raises(ValueError, match="backend"):
        make_llm(v1_dir, "carrier-pigeon")
    gloo = make_llm(v1_dir, "gloo")
    with pytest.raises(EngineStateError, match="init_weight_transfer_engine first"):
        gloo.start_weight_update()
    with pytest.raises(ValueError, match="master_port"):
        gloo.init_weight_transfer_engine({"master_address": "127.0.0.1", "world_size": 2})


class LyingSource(TensorSource):
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(NORM, torch.float32, (32,))]


def test_trainer_side_disagreement_is_caught_before_the_engine_hears(v1_dir) -> None:
    llm = make_llm(v1_dir)
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), InProcessWeightSyncClient(llm), LyingSource([(NORM, torch.ones(64))])
    )
    with pytest.raises(ValueError, match="element 0 disagrees"):
        engine.send_weights()
    assert not llm.engine.weight_sync.round_open
    assert llm.get_weight_info()["version"] == 0


def test_a_write_failing_midway_stops_generation_until_a_complete_round(
    v1_dir, v2_trainer, monkeypatch
) -> None:
    llm = make_llm(v1_dir)
    model = llm.engine.runner.model
    original = model.load_weights

    def half_then_fail(weights):  # noqa: ANN001, ANN202
        items = list(weights)
        original(items[:1])
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(model, "load_weights", half_then_fail)
    with pytest.raises(RuntimeError, match="weights are incomplete"):
        send(llm, [(NORM, torch.ones(64)), ("lm_head.weight", torch.ones(384, 64))])
    with pytest.raises(EngineStateError, match="weights are incomplete"):
        llm.generate(["never on half-written weights"], use_tqdm=False)
    monkeypatch.setattr(model, "load_weights", original)
    with pytest.raises(EngineStateError, match="weights are incomplete"):  # partial: not enough
        send(llm, [(NORM, torch.ones(64))]) or llm.generate(["still refused"], use_tqdm=False)
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), InProcessWeightSyncClient(llm), ModuleSource(v2_trainer)
    ).send_weights("complete")
    assert llm.generate(["runs again"], use_tqdm=False)[0].finished


def test_engine_refusal_reaches_a_gloo_trainer_at_once(v1_dir, v2_trainer) -> None:
    import time

    plain = LLM(str(v1_dir), dtype="float32", progress=False)  # no transfer configured
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(EngineStateError, match="not configured"):
        WeightTransferTrainerFactory.trainer_init(
            info, InProcessWeightSyncClient(plain), ModuleSource(v2_trainer)
        )
    assert time.monotonic() - start < 10  # not the 60 s rendezvous timeout


def test_disk_trainer_never_touches_a_foreign_checkpoint(v1_dir, tmp_path) -> None:
    from hotswap.weight_transfer import DiskTrainerInitInfo

    (tmp_path / "model.safetensors").write_bytes(b"somebody's checkpoint")
    llm = make_llm(v1_dir, "disk")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        WeightTransferTrainerFactory.trainer_init(
            DiskTrainerInitInfo(directory=str(tmp_path)),
            InProcessWeightSyncClient(llm),
            TensorSource([]),
        )
    assert (tmp_path / "model.safetensors").read_bytes() == b"somebody's checkpoint"


def test_sleep_and_disk_reload_wait_for_an_open_round(v1_dir) -> None:
    llm = LLM(
        str(v1_dir),
        dtype="float32",
        progress=False,
        enable_sleep_mode=True,
        weight_transfer_config={"backend": "ipc"},
    )
    llm.start_weight_update()
    with pytest.raises(EngineStateError, match="round is open"):
        llm.engine.sleep_manager.sleep(2)
    with pytest.raises(EngineStateError, match="round is open"):
        llm.engine.weight_manager.load_from_disk(str(v1_dir))
    llm.finish_weight_update(abort=True)
    assert llm.engine.sleep_manager.sleep(2) == []  # allowed again once the round is closed
