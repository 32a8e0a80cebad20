"""Rounds of weights a trainer quantized itself, as slime, AReaL and verl send them to an
SGLang engine serving FP8: each FP8 layer's checkpoint tensor as e4m3 codes with its
float32 `weight_scale_inv` (vLLM's blockwise arithmetic, which hotswap's quantizer is), the
other tensors as they are. They are written as sent, so a round equals a fresh FP8 engine
loaded from the trainer's bf16 weights (digest); codes without their scales (or scales
without their codes) are refused as a whole and change nothing, and so are FP8 tensors
sent as a sparse delta or to tensor-parallel ranks (each quantizes its own share)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM
from hotswap.errors import InvalidArgument
from hotswap.quantization.fp8 import quantize_blockwise
from hotswap.weight_transfer import TensorSource
from tests.weight_transfer.test_fp8_rounds import BLOCK, FP8, digest, fp8_llm, send

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def trainer_quantized(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """What the trainer sends: every projection as codes and scales, the rest as is."""
    sent = []
    for name, tensor in weights.items():
        if name.endswith("proj.weight"):
            codes, scales = quantize_blockwise(tensor, tuple(BLOCK))
            sent += [(name, codes), (name.removesuffix("weight") + "weight_scale_inv", scales)]
        else:
            sent.append((name, tensor))
    return sent


@pytest.mark.parametrize(
    ("backend", "double_buffer"),
    [("ipc", False), pytest.param("gloo", False, marks=pytest.mark.slow),
     pytest.param("ipc", True, marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_trainer_quantized_round_equals_a_fresh_fp8_engine(
    backend: str, double_buffer: bool, v1_dir: Path, v2_dir: Path
) -> None:
    llm = fp8_llm(v1_dir, backend, require_complete=True, double_buffer=double_buffer)
    send(llm, TensorSource(trainer_quantized(load_file(v2_dir / "model.safetensors"))), backend)
    assert digest(llm) == digest(fp8_llm(v2_dir, None)) != digest(fp8_llm(v1_dir, None))


@pytest.mark.slow
def test_trainer_quantized_experts_and_inline_tensors(tiny_model_factory) -> None:  # noqa: ANN001
    """Per-expert codes and scales of a mixture of experts, by value (SGLang's
    update_weights_from_tensor), only the tensors sent changing."""
    v1_dir = tiny_model_factory("qwen3_moe", seed=0)
    v2_dir = tiny_model_factory("qwen3_moe", seed=1)
    llm = fp8_llm(v1_dir, None)
    v2 = load_file(v2_dir / "model.safetensors")
    llm.load_weights_inline(trainer_quantized(v2), "v2")
    assert digest(llm) == digest(fp8_llm(v2_dir, None))


@pytest.mark.slow
@pytest.mark.parametrize("what", ["codes alone", "scales alone"])
def test_unpaired_codes_or_scales_are_refused_and_change_nothing(
    what: str, v1_dir: Path, v2_dir: Path
) -> None:
    v2 = load_file(v2_dir / "model.safetensors")
    codes, scales = dict(trainer_quantized({Q_PROJ: v2[Q_PROJ]})).values()
    scale_name = Q_PROJ.removesuffix("weight") + "weight_scale_inv"
    alone = [(Q_PROJ, v2[Q_PROJ]), (scale_name, scales)]  # a bf16 weight, and scales
    items = [(Q_PROJ, codes)] if what == "codes alone" else alone
    for inline in (False, True):
        llm = fp8_llm(v1_dir, "ipc")
        before = llm.get_weight_info()
        with pytest.raises(InvalidArgument, match="nothing was applied") as caught:
            if inline:
                llm.load_weights_inline(items)
            else:
                send(llm, TensorSource(items), "ipc")
        assert (scale_name if what == "codes alone" else Q_PROJ) in str(caught.value)
        assert llm.get_weight_info() == before
        send(llm, TensorSource(trainer_quantized({Q_PROJ: v2[Q_PROJ]})), "ipc")  # then paired
        assert llm.get_weight_info()["version"] == before["version"] + 1


@pytest.mark.slow
def test_fp8_tensors_to_tensor_parallel_ranks_are_refused(v1_dir: Path, v2_dir: Path) -> None:
    v2 = load_file(v2_dir / "model.safetensors")
    llm = LLM(str(v1_dir), dtype="float32", progress=False, tensor_parallel_size=2,
              weight_transfer_config={"backend": "ipc"}, **FP8)  # fmt: skip
    before = llm.get_weight_info()
    with pytest.raises(ValueError, match="tensor-parallel ranks"):
        send(llm, TensorSource(trainer_quantized({Q_PROJ: v2[Q_PROJ]})), "ipc")
    assert llm.get_weight_info() == before
    llm.shutdown()


@pytest.mark.slow
def test_fp8_values_in_a_sparse_delta_are_refused(v1_dir: Path) -> None:
    from hotswap.weight_transfer import (
        InProcessWeightSyncClient,
        SparsePatch,
        SparseTrainerInitInfo,
        WeightTransferTrainerFactory,
    )
    from tests.weight_transfer.conftest import free_port

    llm = fp8_llm(v1_dir, "sparse")
    before = llm.get_weight_info()
    engine = WeightTransferTrainerFactory.trainer_init(
        SparseTrainerInitInfo(master_port=free_port(), world_size=2),
        InProcessWeightSyncClient(llm), None,
    )  # fmt: skip
    values = torch.tensor([0.5, -0.25]).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="sparse delta"):
        engine.send_patches([SparsePatch(Q_PROJ, (64, 64), torch.tensor([3, 70]), values)], "x")
    assert llm.get_weight_info() == before
