"""Rounds into an FP8 mixture of experts (`--quantization fp8` quantizes the routed
experts too): the trainer's bf16 tensors, stacked (transformers 5's `mlp.experts.gate_up_proj`)
or per expert (`mlp.experts.3.gate_proj.weight`), are quantized on receipt one expert's
matrix at a time, so every round lands on the codes and scales a fresh FP8 engine loads
from the same weights (digest); a sparse delta lands on the dequantized experts; tensor
and expert parallelism give one rank's tokens. The stacked round is the quick check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.quantization.fp8 import dequantize_blockwise, quantize_blockwise
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    ModuleSource,
    SparsePatch,
    SparseTrainerInitInfo,
    TensorSource,
    WeightTransferTrainerFactory,
)
from tests.weight_transfer.conftest import free_port, trainer_model
from tests.weight_transfer.test_fp8_rounds import BLOCK, FP8, checkpoint, digest, fp8_llm, send

GATE = "model.layers.0.mlp.experts.3.gate_proj.weight"
DOWN = "model.layers.2.mlp.experts.5.down_proj.weight"


@pytest.fixture(scope="module")
def moe_dirs(tiny_model_factory) -> tuple[Path, Path]:  # noqa: ANN001
    return tiny_model_factory("qwen3_moe", seed=0), tiny_model_factory("qwen3_moe", seed=1)


def experts_of(llm: LLM, layer: int = 0):  # noqa: ANN201
    return llm.engine.runner.model.model.layers[layer].mlp.experts


def test_a_stacked_bf16_round_equals_a_fresh_fp8_engine(moe_dirs, tmp_path) -> None:  # noqa: ANN001
    v1_dir, v2_dir = moe_dirs
    bf16 = trainer_model(v2_dir, torch.bfloat16)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in bf16.named_parameters())
    llm = fp8_llm(v1_dir, require_complete=True)
    send(llm, ModuleSource(bf16))
    sent = {name: p.detach() for name, p in bf16.named_parameters()}
    fresh = fp8_llm(checkpoint(tmp_path / "bf16", v2_dir, sent), None)
    assert digest(llm) == digest(fresh)
    # expert 3's up rows: quantized on their own, as a checkpoint naming them would be
    experts, inter = experts_of(llm), experts_of(llm).down_proj.shape[2]
    codes, scales = quantize_blockwise(
        sent["model.layers.0.mlp.experts.gate_up_proj"][3, inter:], tuple(BLOCK)
    )
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert torch.equal(experts.gate_up_proj[3, inter:].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv[3, -scales.shape[0] :], scales)
    # the same weights under per-expert names: the same codes (one grid per expert's matrix)
    named = checkpoint(tmp_path / "per-expert", v2_dir, per_expert_names(sent))
    assert digest(fp8_llm(named, None)) == digest(llm) != digest(fp8_llm(v1_dir, None))


def per_expert_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts as the hub's checkpoints name them."""
    named = {}
    for name, tensor in weights.items():
        layer, _, stacked = name.partition(".mlp.experts.")
        if stacked == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                named[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                named[f"{layer}.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif stacked == "down_proj":
            for e, down in enumerate(tensor):
                named[f"{layer}.mlp.experts.{e}.down_proj.weight"] = down.contiguous()
        else:
            named[name] = tensor
    return named


@pytest.mark.slow
def test_a_round_of_some_experts_requantizes_only_them(moe_dirs, tmp_path) -> None:  # noqa: ANN001
    v1_dir, v2_dir = moe_dirs
    v1, v2 = load_file(v1_dir / "model.safetensors"), load_file(v2_dir / "model.safetensors")
    llm = fp8_llm(v1_dir)
    before = experts_of(llm).gate_up_proj_scale_inv.clone()
    send(llm, TensorSource([(GATE, v2[GATE].bfloat16()), (DOWN, v2[DOWN].bfloat16())]))
    mixed = {**v1, GATE: v2[GATE].bfloat16().float(), DOWN: v2[DOWN].bfloat16().float()}
    assert digest(llm) == digest(fp8_llm(checkpoint(tmp_path / "mixed", v1_dir, mixed), None))
    after = experts_of(llm).gate_up_proj_scale_inv
    changed = (after != before).flatten(1).any(dim=1)
    assert changed.tolist() == [e == 3 for e in range(len(changed))]


@pytest.mark.slow
def test_a_sparse_delta_on_an_expert_requantizes_its_blocks(moe_dirs, tmp_path) -> None:  # noqa: ANN001
    v1_dir, _ = moe_dirs
    llm = fp8_llm(v1_dir, "sparse")
    engine = WeightTransferTrainerFactory.trainer_init(
        SparseTrainerInitInfo(master_port=free_port(), world_size=2),
        InProcessWeightSyncClient(llm), None,
    )  # fmt: skip
    weights = load_file(v1_dir / "model.safetensors")
    shape = tuple(weights[DOWN].shape)
    indices = torch.tensor([3, shape[1] * 20 + 7])
    values = torch.tensor([0.5, -0.25])
    engine.send_patches([SparsePatch(DOWN, shape, indices, values)], "delta")
    for name in [n for n in weights if n.endswith("proj.weight")]:
        codes, scales = quantize_blockwise(weights[name], tuple(BLOCK))
        weights[name] = dequantize_blockwise(codes, scales, tuple(BLOCK), torch.float32)
    weights[DOWN].view(-1)[indices] = values
    assert digest(llm) == digest(fp8_llm(checkpoint(tmp_path / "delta", v1_dir, weights), None))


@pytest.mark.slow
def test_a_double_buffered_round_of_stacked_experts(moe_dirs) -> None:  # noqa: ANN001
    v1_dir, v2_dir = moe_dirs
    llm = fp8_llm(v1_dir, "ipc", double_buffer=True)
    before = digest(llm)
    send(llm, ModuleSource(trainer_model(v2_dir, torch.bfloat16)), "ipc")
    reference = fp8_llm(v1_dir, "ipc")
    send(reference, ModuleSource(trainer_model(v2_dir, torch.bfloat16)), "ipc")
    assert digest(llm) == digest(reference) != before


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_fp8_experts_on_two_ranks_give_one_ranks_tokens(expert_parallel, moe_dirs) -> None:  # noqa: ANN001
    """A bf16 round into two ranks (each quantizes its share of every expert, or its
    experts whole) gives the tokens and logprobs of one FP8 rank loaded from the same
    weights."""
    v1_dir, v2_dir = moe_dirs
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    prompts = [{"prompt_token_ids": [1, 5, 9, 14, 3]}, {"prompt_token_ids": [7, 2, 11]}]
    two = LLM(str(v1_dir), dtype="float32", progress=False, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, weight_transfer_config={"backend": "ipc"},
              **FP8)  # fmt: skip
    send(two, ModuleSource(trainer_model(v2_dir, torch.float32)), "ipc")
    one = fp8_llm(v2_dir, None)
    for got, want in zip(two.generate(prompts, params), one.generate(prompts, params), strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        got_lp = [next(iter(d.values())).logprob for d in got.outputs[0].logprobs]
        want_lp = [next(iter(d.values())).logprob for d in want.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=0)
    two.shutdown()
