"""Rounds into an FP8 engine (`--quantization fp8`): the trainer's bf16/float32 tensors are
quantized on receipt, so a round (whole, partial, double-buffered) lands on exactly the
codes and scales a fresh FP8 engine loads from the same weights (digest), and a sparse
delta on what loading the dequantized weights with the delta gives; FP8 codes, scales or
engine-format names sent are refused, naming the field, and change nothing (FP8 codes
without their scales, or scales without their codes); an FP8 checkpoint loads as it is.
One bf16 round is the quick check; the rest start several engines each: slow."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.quantization.fp8 import dequantize_blockwise, quantize_blockwise
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


@pytest.mark.slow
def test_a_partial_round_requantizes_only_what_it_sends(v1_dir, v2_dir, tmp_path) -> None:
    v1, v2 = load_file(v1_dir / "model.safetensors"), load_file(v2_dir / "model.safetensors")
    llm = fp8_llm(v1_dir)
    send(llm, TensorSource([(Q_PROJ, v2[Q_PROJ]), (DOWN, v2[DOWN])]))
    mixed = {**v1, Q_PROJ: v2[Q_PROJ], DOWN: v2[DOWN]}
    assert digest(llm) == digest(fp8_llm(checkpoint(tmp_path / "mixed", v1_dir, mixed), None))
    assert digest(llm) != digest(fp8_llm(v1_dir, None))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("items", "message"),
    [
        # a trainer's own FP8 codes come with their scales, and scales with their codes
        # (tests/weight_transfer/test_fp8_trainer_quantized.py)
        ([(Q_PROJ, torch.zeros(64, 64, dtype=torch.float8_e4m3fn))], "without its scales"),
        ([(Q_PROJ.replace("weight", "weight_scale_inv"), torch.ones(4, 4))], "as FP8 codes"),
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


@pytest.mark.slow
def test_engine_format_is_refused(v1_dir) -> None:
    llm = fp8_llm(v1_dir, "ipc")
    before = llm.get_weight_info()
    llm.start_weight_update(is_checkpoint_format=False)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    info = {"names": [name], "dtype_names": ["float32"], "shapes": [[128, 64]]}
    with pytest.raises(ValueError, match="checkpoint format"):
        llm.update_weights(info | {"segments": ["x"], "placements": [[0, 0]]})
    llm.finish_weight_update(abort=True)
    assert llm.get_weight_info() == before


@pytest.mark.slow
def test_a_sparse_delta_requantizes_the_blocks_it_touches(v1_dir, tmp_path) -> None:
    """The delta lands on the dequantized weight; the result equals a fresh FP8 engine
    loaded from the dequantized weights with the delta applied (untouched blocks keep
    their codes and scales: quantizing dequantized values gives them back)."""
    llm = fp8_llm(v1_dir, "sparse")
    engine = WeightTransferTrainerFactory.trainer_init(
        SparseTrainerInitInfo(master_port=free_port(), world_size=2),
        InProcessWeightSyncClient(llm), None,
    )  # fmt: skip
    indices = torch.tensor([3, 64 * 20 + 7, 64 * 20 + 8])  # two blocks of q_proj
    values = torch.tensor([0.5, -0.25, 0.125])
    engine.send_patches([SparsePatch(Q_PROJ, (64, 64), indices, values)], "delta")
    weights = load_file(v1_dir / "model.safetensors")
    for name in [n for n in weights if n.endswith("proj.weight")]:
        codes, scales = quantize_blockwise(weights[name], tuple(BLOCK))
        weights[name] = dequantize_blockwise(codes, scales, tuple(BLOCK), torch.float32)
    weights[Q_PROJ].view(-1)[indices] = values
    fresh = fp8_llm(checkpoint(tmp_path / "delta", v1_dir, weights), None)
    assert digest(llm) == digest(fresh)
    assert digest(llm) != digest(fp8_llm(v1_dir, None))


@pytest.mark.slow
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_a_double_buffered_round_swaps_in_the_quantized_weights(partial, v1_dir, v2_dir) -> None:
    """The round is quantized into the shadow (codes and their scale rows) while the live
    FP8 weights serve; the commit swaps both in."""
    v2 = load_file(v2_dir / "model.safetensors")
    llm = fp8_llm(v1_dir, "ipc", double_buffer=True)
    before = digest(llm)
    if partial:
        send(llm, TensorSource([(Q_PROJ, v2[Q_PROJ].bfloat16())]), "ipc")
        reference = fp8_llm(v1_dir, "ipc")
        send(reference, TensorSource([(Q_PROJ, v2[Q_PROJ].bfloat16())]), "ipc")
    else:
        send(llm, TensorSource(list(v2.items())), "ipc")
        reference = fp8_llm(v2_dir, None)
    assert digest(llm) == digest(reference) != before
    send(llm, TensorSource(list(load_file(v1_dir / "model.safetensors").items())), "ipc")
    assert digest(llm) == before  # the other buffer, rewritten: round two


@pytest.mark.slow
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


@pytest.mark.slow
def test_sleep_and_wake_keep_the_fp8_weights(v1_dir) -> None:
    llm = LLM(str(v1_dir), dtype="float32", progress=False, enable_sleep_mode=True, **FP8)
    before = digest(llm)
    llm.sleep(level=1)
    llm.wake_up()
    assert digest(llm) == before


@pytest.mark.slow
@pytest.mark.parametrize("double_buffer", [False, True])
def test_an_in_flight_round_lands_between_steps(double_buffer, v1_dir, v2_dir, v2_trainer) -> None:
    """Received and quantized beside the steps of a running stream, switched between two
    steps: its later tokens carry version 1, and the weights equal a fresh FP8 engine's."""
    config = {"backend": "gloo", "in_flight": True, "double_buffer": double_buffer}

    async def run() -> tuple[list[int], str]:
        llm = AsyncLLM(str(v1_dir), dtype="float32", weight_transfer_config=config, **FP8)
        try:
            await llm.get_weight_version()  # binds the engine to this event loop
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            client, source = InProcessWeightSyncClient(llm), ModuleSource(v2_trainer)
            make = WeightTransferTrainerFactory.trainer_init
            trainer = await asyncio.to_thread(make, info, client, source)
            params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
            seen, last = [0], None

            async def stream() -> None:  # noqa: E306
                nonlocal last
                async for out in llm.generate("The quick brown", params, request_id="s"):
                    seen[0], last = len(out.outputs[0].token_ids), out.outputs[0]

            task = asyncio.ensure_future(stream())
            await until_async(lambda: seen[0] >= 5)
            await asyncio.to_thread(trainer.send_weights, "v2")
            await asyncio.wait_for(task, 120)
            return [s.version for s in last.weight_versions], (await llm.get_weight_info())[
                "digest"
            ]
        finally:
            llm.shutdown()

    versions, got = asyncio.run(run())
    assert versions in ([0, 1], [0])
    assert got == digest(fp8_llm(v2_dir, None))


async def until_async(condition, timeout: float = 60) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)
