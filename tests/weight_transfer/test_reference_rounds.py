"""Rounds into an FP8 engine that keeps reference weights (Fp8Config.keep_reference,
model/reference.py): after every round each reference is what a bf16 engine holds, from
the weights sent alone (checkpoint tensors as the engine fuses them, rounded to bf16):
whole, partial, sparse (the values scattered, not the requantized ones), double-buffered
(an aborted round changes nothing), a mixture of experts, tensor-parallel ranks (each
rank's reference is a bf16 engine's share), and a round a trainer quantized (no bf16
exists: the dequantized codes). The digest stays an FP8 engine's without references.
One bf16 round and the trainer-quantized one are the quick checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM
from hotswap.model.reference import fp8_layers
from hotswap.quantization.fp8 import dequantize_blockwise
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    ModuleSource,
    SparsePatch,
    SparseTrainerInitInfo,
    TensorSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.references import stacked_checkpoint
from tests.weight_transfer.conftest import free_port, trainer_model
from tests.weight_transfer.test_fp8_rounds import BLOCK, DOWN, FP8, Q_PROJ, digest, send
from tests.weight_transfer.test_fp8_trainer_quantized import trainer_quantized
from tests.weights.test_double_buffer import abort_round


def engine(path: Path, backend: str | None = "gloo", references: bool = True,  # noqa: ANN001
           **args) -> LLM:  # fmt: skip
    """A bf16 FP8 engine; `args` beyond LLM's are the weight-transfer config's."""
    llm_args = {k: args.pop(k) for k in ("tensor_parallel_size", "worker_extension_cls")
                if k in args}  # fmt: skip
    config = {"backend": backend, **args} if backend else None
    llm = LLM(str(path), dtype="bfloat16", progress=False, weight_transfer_config=config,
              enable_bf16_logprobs=references, **FP8, **llm_args)  # fmt: skip
    return llm


def check_references(llm: LLM, weights: dict[str, torch.Tensor]) -> None:
    """Every reference is checkpoint `weights`' tensor(s) in bf16, bit for bit."""
    layers = list(fp8_layers(llm.engine.runner.model))
    assert layers
    for name, layer in layers:
        want = stacked_checkpoint(weights, name).bfloat16()
        assert torch.equal(layer.fp8.reference, want), name


def checkpoint_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_a_bf16_round_sets_the_references_to_what_it_sent(v1_dir, v2_dir) -> None:  # noqa: ANN001
    bf16 = trainer_model(v2_dir, torch.bfloat16)
    sent = {name: p.detach() for name, p in bf16.named_parameters()}
    llm, plain = engine(v1_dir), engine(v1_dir, references=False)
    check_references(llm, checkpoint_of(v1_dir))
    for target in (llm, plain):
        send(target, ModuleSource(bf16))
    check_references(llm, sent)
    assert digest(llm) == digest(plain)


@pytest.mark.slow
def test_a_partial_round_sets_only_the_references_it_sends(v1_dir, v2_dir) -> None:  # noqa: ANN001
    v1, v2 = checkpoint_of(v1_dir), checkpoint_of(v2_dir)
    llm, plain = engine(v1_dir), engine(v1_dir, references=False)
    for target in (llm, plain):
        send(target, TensorSource([(Q_PROJ, v2[Q_PROJ]), (DOWN, v2[DOWN])]))
    check_references(llm, {**v1, Q_PROJ: v2[Q_PROJ], DOWN: v2[DOWN]})  # q rows of qkv only
    assert digest(llm) == digest(plain)


@pytest.mark.slow
@pytest.mark.parametrize("double_buffer", [False, True], ids=["copy", "swap"])
def test_a_sparse_delta_sets_the_values_it_sends(double_buffer, v1_dir) -> None:  # noqa: ANN001
    """The reference takes the values (as a bf16 engine scatters them), not the
    requantized blocks the codes hold."""
    llm, plain = (engine(v1_dir, "sparse", references=r, double_buffer=double_buffer)
                  for r in (True, False))  # fmt: skip
    indices = torch.tensor([3, 64 * 20 + 7, 64 * 20 + 8])
    values = torch.tensor([0.5, -0.25, 0.123456])  # the last one is no bf16 number
    for target in (llm, plain):
        WeightTransferTrainerFactory.trainer_init(
            SparseTrainerInitInfo(master_port=free_port(), world_size=2),
            InProcessWeightSyncClient(target), None,
        ).send_patches([SparsePatch(Q_PROJ, (64, 64), indices, values)], "delta")  # fmt: skip
    weights = checkpoint_of(v1_dir)
    weights[Q_PROJ].view(-1)[indices] = values
    check_references(llm, weights)
    assert digest(llm) == digest(plain)


@pytest.mark.slow
def test_double_buffered_rounds_swap_the_references_in(v1_dir, v2_dir) -> None:  # noqa: ANN001
    """Written into the shadow's references while the live ones serve, swapped in at the
    commit; an aborted round changes none; a partial round after a swap takes the other
    rows from the live references, not the shadow's older ones."""
    v1, v2 = checkpoint_of(v1_dir), checkpoint_of(v2_dir)
    llm = engine(v1_dir, "ipc", double_buffer=True)
    plain = engine(v1_dir, "ipc", references=False, double_buffer=True)
    model = llm.engine.runner.model
    live = {name: layer.fp8.reference for name, layer in fp8_layers(model)}
    abort_round(llm, TensorSource(list(v2.items())))
    check_references(llm, v1)
    rounds = [(list(v2.items()), v2), ([(Q_PROJ, v1[Q_PROJ])], {**v2, Q_PROJ: v1[Q_PROJ]}),
              ([(DOWN, v1[DOWN])], {**v2, Q_PROJ: v1[Q_PROJ], DOWN: v1[DOWN]})]  # fmt: skip
    for items, want in rounds:
        for target in (llm, plain):
            send(target, TensorSource(items), "ipc")
        check_references(llm, want)
        assert digest(llm) == digest(plain)
    # the layout keeps its tensors; their data is the other buffer's after a swap
    assert all(layer.fp8.reference is live[name] for name, layer in fp8_layers(model))


@pytest.mark.parametrize(
    "double_buffer", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["copy", "swap"]
)
def test_a_trainer_quantized_round_sets_the_dequantized_weights(
    double_buffer, v1_dir, v2_dir
) -> None:  # noqa: ANN001
    """Codes and scales come apart (separate tensors); the references are derived at the
    commit. A double-buffered round aborted first leaves them as they were."""
    v1, v2 = checkpoint_of(v1_dir), checkpoint_of(v2_dir)
    llm = engine(v1_dir, "ipc", double_buffer=double_buffer)
    plain = engine(v1_dir, "ipc", references=False, double_buffer=double_buffer)
    sent = dict(trainer_quantized(v2))
    if double_buffer:
        abort_round(llm, TensorSource(list(sent.items())))
        send(llm, TensorSource([("model.norm.weight", v2["model.norm.weight"])]), "ipc")
        check_references(llm, {**v1, "model.norm.weight": v2["model.norm.weight"]})
    for target in (llm, plain):
        send(target, TensorSource(list(sent.items())), "ipc")
    dequantized = dict(v2)
    for name in [n for n, tensor in sent.items() if tensor.dtype == torch.float8_e4m3fn]:
        scales = sent[name.removesuffix("weight") + "weight_scale_inv"]
        dequantized[name] = dequantize_blockwise(sent[name], scales, tuple(BLOCK), torch.float32)
    check_references(llm, dequantized)
    assert not torch.equal(dequantized[Q_PROJ].bfloat16(), v2[Q_PROJ].bfloat16())
    assert digest(llm) == digest(plain)


@pytest.fixture(scope="module")
def moe_dirs(tiny_model_factory) -> tuple[Path, Path]:  # noqa: ANN001
    return tiny_model_factory("qwen3_moe", seed=0), tiny_model_factory("qwen3_moe", seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("double_buffer", [False, True], ids=["copy", "swap"])
def test_rounds_of_experts_set_their_references(double_buffer, moe_dirs) -> None:  # noqa: ANN001
    """transformers 5's stacked experts whole, then one expert's gate rows and a sparse
    delta on another's down_proj (per-expert names)."""
    v1_dir, v2_dir = moe_dirs
    v1, v2 = checkpoint_of(v1_dir), checkpoint_of(v2_dir)
    llm = engine(v1_dir, "ipc", double_buffer=double_buffer)
    plain = engine(v1_dir, "ipc", references=False, double_buffer=double_buffer)
    stacked = trainer_model(v2_dir, torch.bfloat16)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in stacked.named_parameters())
    for target in (llm, plain):
        send(target, ModuleSource(stacked), "ipc")
    check_references(llm, v2)  # the stacked bf16 tensors are v2's rounded, as the want
    gate = "model.layers.0.mlp.experts.3.gate_proj.weight"
    for target in (llm, plain):
        send(target, TensorSource([(gate, v1[gate])]), "ipc")
    check_references(llm, {**v2, gate: v1[gate]})
    assert digest(llm) == digest(plain)


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_a_bf16_engines_shares(v1_dir, v2_dir) -> None:  # noqa: ANN001
    """Each rank quantizes its share and keeps it as sent: its references are the
    parameters a bf16 engine's same rank holds."""
    probe = "tests.helpers.references:ReferenceProbe"
    two = engine(v1_dir, "ipc", tensor_parallel_size=2, worker_extension_cls=probe)
    send(two, TensorSource(list(checkpoint_of(v2_dir).items())), "ipc")
    got = two.collective_rpc("reference_hashes")
    two.shutdown()
    bf16 = LLM(str(v2_dir), dtype="bfloat16", progress=False, tensor_parallel_size=2,
               worker_extension_cls=probe)  # fmt: skip
    want = bf16.collective_rpc("parameter_hashes", args=(sorted(got[0]),))
    bf16.shutdown()
    assert len(got) == 2 and got[0] != got[1]
    assert got == want
