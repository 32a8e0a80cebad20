"""Rounds into an FP8 engine (`--quantization fp8`): the trainer's bf16/float32 tensors are
quantized on receipt, so a round lands on exactly the codes and scales a fresh FP8 engine
loads from the same weights (digest); what quantize-on-receipt does not cover yet is
refused, naming the field, and changes nothing; an FP8 checkpoint loads as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM
from hotswap.errors import InvalidArgument
from hotswap.quantization.fp8 import quantize_blockwise
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    SparsePatch,
    SparseTrainerInitInfo,
    TensorSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port, trainer_model

BLOCK = [16, 16]
QUANTIZATION_CONFIG = {"quant_method": "fp8", "weight_block_size": BLOCK}
FP8 = {"quantization": "fp8", "hf_overrides": {"quantization_config": QUANTIZATION_CONFIG}}
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


def fp8_llm(path: Path, backend: str | None = "gloo", **transfer) -> LLM:
    config = {"backend": backend, **transfer} if backend else None
    return LLM(str(path), dtype="float32", progress=False, weight_transfer_config=config, **FP8)


def digest(llm: LLM) -> str:
    return llm.get_weight_info()["digest"]


def checkpoint(tmp: Path, source: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`source`'s directory with other weights."""
    shutil.copytree(source, tmp)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    return tmp


def send(llm: LLM, source, backend: str = "gloo", label: str = "sent") -> None:  # noqa: ANN001
    info = (GlooTrainerInitInfo(master_port=free_port(), world_size=2) if backend == "gloo"
            else IPCTrainerInitInfo())  # fmt: skip
    WeightTransferTrainerFactory.trainer_init(
        info, InProcessWeightSyncClient(llm), source
    ).send_weights(label)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("ipc", marks=pytest.mark.slow)])
def test_a_bf16_round_equals_a_fresh_fp8_engine(backend, v1_dir, v2_dir, tmp_path) -> None:
    bf16 = trainer_model(v2_dir, torch.bfloat16)
    llm = fp8_llm(v1_dir, backend, require_complete=True)
    send(llm, ModuleSource(bf16), backend)
    sent = {name: p.detach() for name, p in bf16.named_parameters()}
    fresh = fp8_llm(checkpoint(tmp_path / "bf16", v2_dir, sent), None)
    assert digest(llm) == digest(fresh)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    codes, scales = quantize_blockwise(sent[Q_PROJ], tuple(BLOCK))
    assert torch.equal(qkv.weight[: codes.shape[0]].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(qkv.weight_scale_inv[: scales.shape[0]], scales)


def test_a_partial_round_requantizes_only_what_it_sends(v1_dir, v2_dir, tmp_path) -> None:
    v1, v2 = load_file(v1_dir / "model.safetensors"), load_file(v2_dir / "model.safetensors")
    llm = fp8_llm(v1_dir)
    send(llm, TensorSource([(Q_PROJ, v2[Q_PROJ]), (DOWN, v2[DOWN])]))
    mixed = {**v1, Q_PROJ: v2[Q_PROJ], DOWN: v2[DOWN]}
    assert digest(llm) == digest(fp8_llm(checkpoint(tmp_path / "mixed", v1_dir, mixed), None))
    assert digest(llm) != digest(fp8_llm(v1_dir, None))


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([(Q_PROJ, torch.zeros(64, 64, dtype=torch.float8_e4m3fn))], "float8_e4m3fn cannot be"),
        ([(Q_PROJ.replace("weight", "weight_scale_inv"), torch.ones(4, 4))], "not FP8 codes"),
    ],
)
def test_refused_sends_change_nothing(items, message, v1_dir, v2_trainer) -> None:
    llm = fp8_llm(v1_dir, "ipc")
    before = llm.get_weight_info()
    with pytest.raises(ValueError, match=message):
        send(llm, TensorSource(items), "ipc")
    assert llm.get_weight_info() == before
    send(llm, ModuleSource(v2_trainer), "ipc")
    assert llm.get_weight_info()["version"] == before["version"] + 1


def test_engine_format_and_sparse_deltas_are_refused(v1_dir) -> None:
    llm = fp8_llm(v1_dir, "ipc")
    llm.start_weight_update(is_checkpoint_format=False)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    info = {"names": [name], "dtype_names": ["float32"], "shapes": [[128, 64]]}
    with pytest.raises(ValueError, match="checkpoint format"):
        llm.update_weights(info | {"segments": ["x"], "placements": [[0, 0]]})
    llm.finish_weight_update(abort=True)
    sparse = fp8_llm(v1_dir, "sparse")
    before = sparse.get_weight_info()
    engine = WeightTransferTrainerFactory.trainer_init(
        SparseTrainerInitInfo(master_port=free_port(), world_size=2),
        InProcessWeightSyncClient(sparse), None,
    )  # fmt: skip
    patch = SparsePatch(Q_PROJ, (64, 64), torch.tensor([3]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="sparse deltas into FP8"):
        engine.send_patches([patch], "delta")
    assert sparse.get_weight_info() == before


@pytest.mark.parametrize("transfer", [{"backend": "ipc", "double_buffer": True},
                                      {"backend": "m2n"}])  # fmt: skip
def test_writes_that_bypass_quantization_are_refused_at_start(transfer, v1_dir) -> None:
    with pytest.raises(InvalidArgument) as caught:
        LLM(str(v1_dir), progress=False, weight_transfer_config=transfer, **FP8)
    assert caught.value.field.startswith("weight_transfer_config.")


def test_an_fp8_checkpoint_loads_as_it_is(v1_dir, tmp_path) -> None:
    weights = load_file(v1_dir / "model.safetensors")
    for name in [n for n in weights if n.endswith("proj.weight")]:
        codes, scales = quantize_blockwise(weights[name], tuple(BLOCK))
        weights[name] = codes
        weights[name.replace("weight", "weight_scale_inv")] = scales
    fp8_dir = checkpoint(tmp_path / "fp8", v1_dir, weights)
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(config))
    loaded = LLM(str(fp8_dir), dtype="float32", progress=False)  # no --quantization needed
    assert digest(loaded) == digest(fp8_llm(v1_dir, None))
    del weights["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    save_file(weights, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match="v_proj.weight_scale_inv"):
        LLM(str(fp8_dir), dtype="float32", progress=False)


def test_sleep_and_wake_keep_the_fp8_weights(v1_dir) -> None:
    llm = LLM(str(v1_dir), dtype="float32", progress=False, enable_sleep_mode=True, **FP8)
    before = digest(llm)
    llm.sleep(level=1)
    llm.wake_up()
    assert digest(llm) == before
