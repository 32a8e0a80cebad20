"""FP8 layers' reference weights (`Fp8Config.keep_reference`, model/reference.py): a
checkpoint's tensors as they are, in the model dtype (against the checkpoint file, not
hotswap), outside the parameters (the digest is an FP8 engine's without them); inside
`serving_reference` an FP8 engine gives the logits of a bf16 engine loaded from the same
checkpoint, bit for bit on the same kernels, and outside it those of an FP8 engine
without references; the fused experts run the bf16 kernel over them."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hotswap import LLM, SamplingParams
from hotswap.model.kernels import CpuKernels
from hotswap.model.layers import Linear
from hotswap.model.moe import FusedExperts, route
from hotswap.model.parallel import TPGroup
from hotswap.model.quantized import quantize_into, quantize_linear
from hotswap.model.reference import fp8_layers, has_references, serving_reference
from hotswap.model.reference_views import REFERENCE_SWITCH, reference_view
from hotswap.quantization.fp8 import Fp8Config, dequantize_blockwise, quantize_blockwise
from tests.helpers.recording import record_logits
from tests.helpers.references import stacked_checkpoint
from tests.model.test_fp8 import QUANTIZED, needs_compiler

PROMPTS = [[5, 9, 14, 3, 22, 7, 30, 11, 2, 19, 8, 40], [7, 2, 11], [13]]
BF16 = {"dtype": "bfloat16", "progress": False, "prepack_weights": False}


def fp8_engine(model_dir: Path, references: bool, **args) -> LLM:  # noqa: ANN001
    return LLM(str(model_dir), quantization="fp8", hf_overrides=QUANTIZED,
               enable_bf16_logprobs=references, **BF16, **args)  # fmt: skip


def references_of(llm: LLM) -> dict[str, torch.Tensor]:
    return {name: layer.fp8.reference for name, layer in fp8_layers(llm.engine.runner.model)}


def greedy(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorder = record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    logits = [torch.stack(recorder.logits[o.request_id]) for o in outs]
    return [o.outputs[0].token_ids for o in outs], logits


@pytest.mark.parametrize(
    "arch", ["llama"] + [pytest.param(a, marks=pytest.mark.slow) for a in ("qwen2", "qwen3_moe")]
)
def test_references_are_the_checkpoint(arch, tiny_model_factory) -> None:  # noqa: ANN001
    model_dir = tiny_model_factory(arch)
    llm = fp8_engine(model_dir, True)
    weights = load_file(model_dir / "model.safetensors")
    model = llm.engine.runner.model
    assert has_references(model)
    refs = references_of(llm)
    assert len(refs) == 8 if arch != "qwen3_moe" else len(refs) == 12  # experts: stacked
    for name, reference in refs.items():
        assert reference.dtype == torch.bfloat16
        assert torch.equal(reference, stacked_checkpoint(weights, name).bfloat16()), name
    parameters = {p.data_ptr() for p in model.parameters()}
    assert not any(r.data_ptr() in parameters for r in refs.values())
    plain = fp8_engine(model_dir, False)
    assert not has_references(plain.engine.runner.model)
    assert llm.get_weight_info()["digest"] == plain.get_weight_info()["digest"]


@pytest.mark.parametrize(
    ("arch", "cpu_kernels"),
    [("llama", True)] + [pytest.param(a, k, marks=pytest.mark.slow)
                         for a, k in [("llama", False), ("qwen3_moe", True), ("qwen3_moe", False)]],
)  # fmt: skip
def test_serving_reference_gives_a_bf16_engines_logits(
    arch, cpu_kernels, tiny_model_factory
) -> None:  # noqa: ANN001
    model_dir = tiny_model_factory(arch)
    llm = fp8_engine(model_dir, True, cpu_kernels=cpu_kernels)
    model = llm.engine.runner.model
    with serving_reference(model):
        assert REFERENCE_SWITCH.active == 1
        got_tokens, got_logits = greedy(llm)
    assert REFERENCE_SWITCH.active == 0
    bf16 = LLM(str(model_dir), cpu_kernels=cpu_kernels, **BF16)
    want_tokens, want_logits = greedy(bf16)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want)  # the same products over the same bf16 weights
    # outside: the FP8 engine's own logits, as one without references gives them
    fp8_tokens, fp8_logits = greedy(llm)
    plain_tokens, plain_logits = greedy(fp8_engine(model_dir, False,
                                                   cpu_kernels=cpu_kernels))  # fmt: skip
    assert fp8_tokens == plain_tokens
    assert all(torch.equal(a, b) for a, b in zip(fp8_logits, plain_logits, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(fp8_logits, want_logits, strict=True))


@pytest.mark.slow
def test_an_fp8_checkpoints_references_are_its_dequantized_weights(
    tiny_model_factory, tmp_path
) -> None:  # noqa: ANN001
    source = tiny_model_factory("llama")
    weights = load_file(source / "model.safetensors")
    dequantized = dict(weights)
    for name in [n for n in weights if n.endswith("proj.weight")]:
        codes, scales = quantize_blockwise(weights[name], tuple(QUANTIZED["quantization_config"]
                                                                ["weight_block_size"]))  # fmt: skip
        weights[name], weights[name.replace("weight", "weight_scale_inv")] = codes, scales
        dequantized[name] = dequantize_blockwise(codes, scales, (16, 16), torch.bfloat16)
    fp8_dir = tmp_path / "fp8"
    shutil.copytree(source, fp8_dir)
    save_file(weights, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZED["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    llm = fp8_engine(fp8_dir, True)
    for name, reference in references_of(llm).items():
        assert torch.equal(reference, stacked_checkpoint(dequantized, name)), name


# -- without an engine --------------------------------------------------------------------
def fp8_linear_layer(keep: bool) -> Linear:
    layer = Linear(64, 64, False, torch.bfloat16)
    quantize_linear(layer, [32, 16, 16], Fp8Config(block=(16, 16), keep_reference=keep))
    return layer


def test_a_reference_is_laid_out_as_the_codes_and_is_no_parameter() -> None:
    layer = fp8_linear_layer(True)
    reference = layer.fp8.reference
    assert reference.shape == layer.weight.shape and reference.dtype == torch.bfloat16
    assert not isinstance(reference, nn.Parameter)
    assert set(dict(layer.named_parameters())) == {"weight", "weight_scale_inv"}
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv"}
    k_rows = reference_view(layer, layer.weight.data.narrow(0, 32, 16))
    assert k_rows.data_ptr() == reference.narrow(0, 32, 16).data_ptr()
    assert k_rows.shape == (16, 64)
    assert fp8_linear_layer(False).fp8.reference is None
    experts = FusedExperts(4, 32, 16, torch.bfloat16, invariant=False)
    experts.quantize(Fp8Config(block=(16, 16), keep_reference=True), "experts", TPGroup())
    stack = experts.fp8["gate_up_proj"]
    up_rows = reference_view(stack, stack.weight.data[1:3].narrow(1, 16, 16))  # 3-D: 2 experts
    assert up_rows.data_ptr() == stack.fp8.reference[1, 16].data_ptr()
    assert up_rows.shape == (2, 16, 32) and up_rows.stride() == stack.fp8.reference.stride()
    assert reference_view(stack, stack.weight.data[3]).data_ptr() == (
        stack.fp8.reference[3].data_ptr()
    )


def test_serving_reference_refuses_a_model_without_references_and_skips_one_without_fp8() -> None:
    model = nn.Sequential(fp8_linear_layer(False))
    with pytest.raises(ValueError, match="keep_reference"), serving_reference(model):
        pass
    assert REFERENCE_SWITCH.active == 0 and not model[0].fp8.serving
    plain = nn.Sequential(Linear(8, 8, False, torch.float32))
    with serving_reference(plain):
        assert REFERENCE_SWITCH.active == 0  # nothing to switch
    assert not has_references(plain)
    model = nn.Sequential(fp8_linear_layer(True))
    with pytest.raises(RuntimeError, match="inside"), serving_reference(model):
        assert model[0].fp8.serving
        raise RuntimeError("inside")
    assert REFERENCE_SWITCH.active == 0 and not model[0].fp8.serving


def test_a_linear_layer_serving_its_reference_is_a_bf16_product() -> None:
    layer = fp8_linear_layer(True)
    weight = torch.randn(64, 64).bfloat16()
    quantize_into(layer.fp8, layer.weight.data, layer.weight_scale_inv.data, weight)
    layer.fp8.reference.copy_(weight)
    x = torch.randn(3, 64).bfloat16()
    fp8_out = layer(x)
    with serving_reference(nn.Sequential(layer)):
        out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, weight))
    assert torch.equal(layer(x), fp8_out) and not torch.equal(out, fp8_out)


@needs_compiler
@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "per-expert"])
def test_fp8_experts_serving_references_run_as_bf16_experts(fused) -> None:  # noqa: ANN001
    kernels = CpuKernels.load(progress=False)
    assert kernels is not None
    if not fused:
        kernels = dataclasses.replace(kernels, fused_moe=None, fused_moe_fp8=None)
    gen = torch.Generator().manual_seed(0)
    fp8 = FusedExperts(8, 64, 32, torch.bfloat16, invariant=False)
    fp8.quantize(Fp8Config(block=(16, 16), keep_reference=True), "experts", TPGroup())
    bf16 = FusedExperts(8, 64, 32, torch.bfloat16, invariant=False)
    for name in ("gate_up_proj", "down_proj"):
        values = (0.2 * torch.randn(getattr(bf16, name).shape, generator=gen)).bfloat16()
        getattr(bf16, name).data.copy_(values)
        stack = fp8.fp8[name]
        quantize_into(stack.fp8, stack.weight.data, stack.weight_scale_inv.data, values)
        stack.fp8.reference.copy_(values)
    fp8.kernels = bf16.kernels = kernels
    for tokens in (1, 5, 40):
        weights, ids = route(torch.randn(tokens, 8, generator=gen), 2, normalise=True)
        x = torch.randn(tokens, 64, generator=gen).bfloat16()
        with torch.no_grad():
            quantized = fp8(x, ids, weights)
            with serving_reference(nn.Sequential(fp8)):
                assert fp8.fused_op() is kernels.fused_moe
                got = fp8(x, ids, weights)
            want = bf16(x, ids, weights)
        assert torch.equal(got, want)
        assert not torch.equal(quantized, want)


@pytest.mark.slow
def test_compiled_decode_steps_keep_their_graphs(tiny_model_factory) -> None:  # noqa: ANN001
    """The switch is one module-level value the graphs guard on: outside serving_reference
    every decode step runs compiled (none recompiles), before and after a reference pass;
    inside, the graphs refuse (the step runs eagerly over the references)."""
    model_dir = tiny_model_factory("llama")
    with torch._dynamo.config.patch(disable=False):
        llm = fp8_engine(model_dir, True)
        stats = llm.engine.stats.get_stats
        assert stats()["compiled_decode"]
        tokens, logits = greedy(llm)
        compiled = stats()["compiled_decode_steps"]
        assert compiled >= 5 and stats()["eager_decode_steps"] == 0  # every decode step
        with serving_reference(llm.engine.runner.model):
            greedy(llm)
        eager = stats()["eager_decode_steps"]
        assert stats()["compiled_decode_steps"] == compiled
        again, again_logits = greedy(llm)
        assert stats()["eager_decode_steps"] == eager
        assert stats()["compiled_decode_steps"] >= 2 * compiled
    assert again == tokens
    assert all(torch.equal(a, b) for a, b in zip(again_logits, logits, strict=True))
