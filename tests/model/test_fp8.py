"""FP8 linear layers: the CPU kernels against float64 products over the dequantized
weight, the torch fallback against the kernels, and a quantized model's logits against
transformers running float32 weights that are the dequantized FP8 ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap.errors import InvalidArgument
from hotswap.model.kernels import load_cpu_kernels
from hotswap.model.models.llama import check_rank_blocks
from hotswap.model.quantized import Fp8Layout
from hotswap.quantization.fp8 import dequantize_blockwise, quantize_blockwise
from tests.model.test_parity import PROMPTS, hf_reference, run_engine

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the engine runs on torch operators here",
)


def fused_weight(sizes: list[int], k: int, block: tuple[int, int], seed: int = 0):  # noqa: ANN201
    """A fused layer's codes and scales, each shard quantized on its own grid, its layout,
    and the dequantized float32 weight."""
    generator = torch.Generator().manual_seed(seed)
    layout = Fp8Layout.for_shards(sizes, block, torch.device("cpu"))
    codes, scales, values = [], [], []
    for size in sizes:
        shard = torch.randn(size, k, generator=generator) * 0.05
        shard[0, :3] = 1e-7  # codes that are e4m3 subnormals
        c, s = quantize_blockwise(shard, block)
        codes.append(c), scales.append(s)
        values.append(dequantize_blockwise(c, s, block, torch.float32))
    return torch.cat(codes), torch.cat(scales), layout, torch.cat(values)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    ("sizes", "k", "block"),
    [
        ([96, 32, 32], 64, (16, 16)),
        ([200], 300, (128, 128)),
        ([48, 48], 40, (32, 16)),
        ([192, 64, 64], 256, (64, 64)),  # bf16 rows: the byte-lookup decode where built
        ([576], 576, (128, 128)),  # the default model's: a half block at the end of K
    ],
)
def test_gemv_kernel_equals_the_dequantized_product(rows, sizes, k, block) -> None:
    assert load_cpu_kernels(progress=False)
    ops = torch.ops.hotswap_cpu
    codes, scales, layout, values = fused_weight(sizes, k, block)
    x = torch.randn(rows, k)
    out = ops.fp8_gemv(x, codes, scales, layout.scale_rows, block[1])
    want = x.double() @ values.double().t()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    out_bf16 = ops.fp8_gemv(x.bfloat16(), codes, scales, layout.scale_rows, block[1])
    assert out_bf16.dtype == torch.bfloat16
    want_bf16 = x.bfloat16().double() @ values.double().t()
    torch.testing.assert_close(out_bf16.double(), want_bf16, rtol=1e-2, atol=1e-2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel_equals_torch(dtype) -> None:
    assert load_cpu_kernels(progress=False)
    codes, scales, layout, values = fused_weight([96, 32, 32], 72, (16, 16))
    kernel = torch.ops.hotswap_cpu.fp8_dequantize(codes, scales, layout.scale_rows, 16, dtype)
    layout.kernels = None
    assert torch.equal(kernel, layout.dequantize(codes, scales, dtype))
    assert torch.equal(layout.dequantize(codes, scales, torch.float32), values)


def test_tensor_parallel_shares_must_be_whole_blocks() -> None:
    check_rank_blocks("o_proj", [64], 128, (64, 64))
    with pytest.raises(InvalidArgument) as caught:
        check_rank_blocks("qkv_proj", [64, 32, 32], 64, (64, 64))
    assert caught.value.field == "quantization_config.weight_block_size"


BLOCK = [16, 16]
QUANTIZED = {"quantization_config": {"quant_method": "fp8", "weight_block_size": BLOCK}}


def dequantized_copy(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir` with every linear layer's weight, each routed expert's included,
    replaced by its dequantized FP8 value (each checkpoint tensor quantized on its own, as
    the engine does); routers, embeddings and the LM head as they are."""
    shutil.copytree(model_dir, out_dir)
    weights = load_file(model_dir / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("proj.weight"):
            assert tensor.dim() == 2, name  # per-expert checkpoint names, no stacked ones
            codes, scales = quantize_blockwise(tensor, tuple(BLOCK))
            weights[name] = dequantize_blockwise(codes, scales, tuple(BLOCK), torch.float32)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


# Llama through the kernels is the quick check; the other engines are slow.
@pytest.mark.parametrize(
    ("arch", "cpu_kernels"),
    [("llama", True)] + [pytest.param(arch, kernels, marks=pytest.mark.slow)
                         for arch, kernels in [("llama", False), ("qwen2", True), ("qwen2", False),
                                               ("qwen3_moe", True), ("qwen3_moe", False)]],
)  # fmt: skip
def test_logits_equal_the_dequantized_model(
    arch, cpu_kernels, tiny_model_factory, tmp_path
) -> None:
    model_dir = tiny_model_factory(arch)
    reference_dir = dequantized_copy(model_dir, tmp_path / "dequantized")
    prompt_ids = [ids for ids in _prompt_ids(model_dir)]
    want_tokens, want_logits = hf_reference(reference_dir, prompt_ids, 6)
    llm, outs, logits = run_engine(
        model_dir, [{"prompt_token_ids": ids} for ids in prompt_ids], 6, quantization="fp8",
        hf_overrides=QUANTIZED, cpu_kernels=cpu_kernels,
    )  # fmt: skip
    model = llm.engine.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    for block in getattr(model, "sparse_blocks", list)():
        assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert block.experts.down_proj.dtype == torch.float8_e4m3fn
    for out, want, got, ref in zip(outs, want_tokens, logits, want_logits, strict=True):
        assert out.outputs[0].token_ids == want
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def _prompt_ids(model_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(prompt).ids for prompt in PROMPTS]
