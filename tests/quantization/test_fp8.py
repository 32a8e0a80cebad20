"""The blockwise FP8 quantizer against vLLM's arithmetic, written here block by block, and
the configurations it refuses, naming the field."""

from __future__ import annotations

import pytest
import torch

from hotswap.config import read_hf_config, resolve_quantization
from hotswap.errors import InvalidArgument
from hotswap.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Config,
    dequantize_blockwise,
    quantize_blockwise,
)


def reference_quantize(weight: torch.Tensor, block: tuple[int, int]):  # noqa: ANN201
    """vLLM's per_block_cast_to_fp8, one block at a time: amax over the block in float32,
    at least 1e-4; scale = amax / 448; codes = value * (1 / scale) rounded to e4m3."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    codes = torch.empty(n, k, dtype=FP8_DTYPE)
    scales = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            part = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            amax = part.abs().float().max().clamp(min=1e-4)
            scale = amax / 448.0
            scales[i, j] = scale
            codes[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                part.float() * (1.0 / scale)
            ).to(FP8_DTYPE)
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "block"),
    [((256, 384), (128, 128)), ((300, 200), (128, 128)), ((70, 45), (16, 32)), ((5, 7), (64, 64))],
)
def test_quantizer_equals_vllm_bitwise(shape, block, dtype) -> None:
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    weight[: block[0], : block[1]] = 0  # an all-zero block: the amax floor
    weight[-1, -1] = 3.0  # an outlier in the last (partial) block
    codes, scales = quantize_blockwise(weight, block)
    want_codes, want_scales = reference_quantize(weight, block)
    assert codes.dtype == FP8_DTYPE and codes.shape == weight.shape
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    values = dequantize_blockwise(codes, scales, block, torch.float32)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each block's amax (half a step at 448)
    assert (values - weight.float()).abs().max() <= scales.max() * 16


def test_config_defaults_and_keys() -> None:
    assert Fp8Config.from_hf(None) == Fp8Config(block=(128, 128))
    config = Fp8Config.from_hf(
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [64, 32], "modules_to_not_convert": ["lm_head", "model.layers.1"]}
    )  # fmt: skip
    assert config.block == (64, 32)
    assert config.quantizes("model.layers.0.mlp.down_proj")
    assert not config.quantizes("model.layers.1.mlp.down_proj")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"fmt": "e5m2"}, "quantization_config.fmt"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme"),
        ({"weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({"weight_block_size": [128, 100]}, "quantization_config.weight_block_size"),
        ({"weight_block_size": [0, 128]}, "quantization_config.weight_block_size"),
        ({"weight_block_size": "128x128"}, "quantization_config.weight_block_size"),
        ({"quant_method": "awq"}, "quantization_config.quant_method"),
        ({"ignored_layers": "lm_head"}, "quantization_config.ignored_layers"),
    ],
)
def test_bad_configs_name_the_field(config, field) -> None:
    with pytest.raises(InvalidArgument, match=field.rsplit(".", 1)[1]) as caught:
        resolve_quantization("fp8", {"quantization_config": config})
    assert caught.value.field == field


def test_the_flag_and_the_checkpoint() -> None:
    assert resolve_quantization(None, {}) is None
    assert resolve_quantization("fp8", {}) == Fp8Config()
    declared = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    assert resolve_quantization(None, declared).block == (32, 32)
    with pytest.raises(InvalidArgument) as caught:
        resolve_quantization("int4", {})
    assert caught.value.field == "quantization"


@pytest.mark.parametrize("overrides", ["{not json", "[1, 2]", 3])
def test_bad_hf_overrides_name_the_flag(overrides, tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(InvalidArgument) as caught:
        read_hf_config(tmp_path, overrides)
    assert caught.value.field == "hf_overrides"
    merged = read_hf_config(tmp_path, '{"quantization_config": {"weight_block_size": [64, 64]}}')
    assert merged["architectures"] == ["LlamaForCausalLM"]
    assert resolve_quantization(None, merged).block == (64, 64)
