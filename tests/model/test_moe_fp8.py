"""A mixture of experts' routed experts in FP8 (`--quantization fp8`): the storage
(model/quantized.py Fp8Stack), and the CPU kernel that runs them in one call
(csrc/moe.cpp fused_moe_fp8) against the per-expert torch path bit for bit and against
the float64 definition over the dequantized weights, on both of the FP8 GEMV's decode
paths (block_k a multiple of 64: the AVX-512 VBMI byte lookups where the CPU has them;
else the float16 trick)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from hotswap.errors import InvalidArgument
from hotswap.model.kernels import CpuKernels
from hotswap.model.moe import FusedExperts, route
from hotswap.model.parallel import TPGroup
from hotswap.model.quantized import quantize_into
from hotswap.quantization.fp8 import Fp8Config, dequantize_blockwise

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the engine runs on torch operators here",
)

HIDDEN, INTER, EXPERTS = 128, 64, 8
BLOCKS = [(16, 64), (32, 16)]  # the VBMI decode's shape, and the float16 trick's


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = CpuKernels.load(progress=False)
    assert loaded is not None  # with a compiler present the build must succeed
    return loaded


def fp8_experts(dtype: torch.dtype, block: tuple[int, int], kernels: CpuKernels | None,
                seed: int = 0) -> FusedExperts:  # fmt: skip
    """Experts with random weights quantized into FP8 storage; its kernels run the torch
    path (one product per expert hit from Python), not the fused call."""
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(EXPERTS, HIDDEN, INTER, dtype, invariant=False)
    experts.quantize(Fp8Config(block=block), "mlp.experts", TPGroup())
    for name, shape in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
        stack = experts.fp8[name]
        values = 0.2 * torch.randn(EXPERTS, *shape, generator=gen)
        quantize_into(stack.fp8, stack.weight.data, stack.weight_scale_inv.data, values)
    experts.kernels = None if kernels is None else dataclasses.replace(kernels, fused_moe_fp8=None)
    return experts


def dequantized(experts: FusedExperts, name: str) -> torch.Tensor:
    stack = experts.fp8[name]
    return torch.stack([dequantize_blockwise(c, s, stack.fp8.block, torch.float64)
                        for c, s in zip(stack.weight, stack.weight_scale_inv)])  # fmt: skip


def definition(experts: FusedExperts, x, ids, weights) -> torch.Tensor:  # noqa: ANN001
    """sum_j weights[t, j] * down[e] @ (silu(gate) * up)(gate_up[e] @ x[t]) over the
    dequantized weights, in float64; a -1 id adds nothing."""
    up_all, down_all = dequantized(experts, "gate_up_proj"), dequantized(experts, "down_proj")
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for j in range(ids.shape[1]):
        e = ids[:, j].clamp(min=0)
        gate, lin = torch.einsum("tnh,th->tn", up_all[e], x).chunk(2, dim=-1)
        hidden = torch.nn.functional.silu(gate) * lin
        kept = weights[:, j].double() * (ids[:, j] >= 0)
        out += kept[:, None] * torch.einsum("thi,ti->th", down_all[e], hidden)
    return out


def close_to_definition(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    tolerance = 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tolerance * scale, rtol=tolerance)


def fused(kernels: CpuKernels, experts: FusedExperts, x, ids, weights) -> torch.Tensor:  # noqa: ANN001
    up, down = experts.fp8["gate_up_proj"], experts.fp8["down_proj"]
    return kernels.fused_moe_fp8(x, up.weight, up.weight_scale_inv, down.weight,
                                 down.weight_scale_inv, ids, weights, *up.fp8.block)  # fmt: skip


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (1, 8), (3, 2), (9, 2), (64, 2), (1024, 8)])
def test_fp8_experts_equal_the_torch_path_and_the_definition(
    kernels, block, dtype, tokens, top_k
) -> None:  # noqa: ANN001
    experts = fp8_experts(dtype, block, kernels)
    gen = torch.Generator().manual_seed(tokens + top_k)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen), top_k, normalise=True)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    got = fused(kernels, experts, x, ids, weights)
    assert got.dtype == dtype and got.shape == x.shape
    with torch.no_grad():
        assert torch.equal(got, experts(x, ids, weights))  # what fp8_linear per expert gives
    close_to_definition(got, definition(experts, x, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_one_expert_for_every_token_and_other_ranks_experts(kernels, dtype) -> None:  # noqa: ANN001
    """40 rows on one expert (the dequantize-and-GEMM path), experts never hit, and
    expert parallelism's -1 ids, which add nothing."""
    experts = fp8_experts(dtype, BLOCKS[0], kernels, seed=3)
    x = torch.randn(40, HIDDEN).to(dtype)
    ids = torch.full((40, 2), 5, dtype=torch.long)
    ids[:, 1] = -1
    ids[7, 1] = 2
    weights = torch.full((40, 2), 0.5)
    got = fused(kernels, experts, x, ids, weights)
    with torch.no_grad():
        assert torch.equal(got, experts(x, ids, weights))
    close_to_definition(got, definition(experts, x, ids, weights))


def test_fp8_experts_bad_inputs_and_blocks(kernels) -> None:  # noqa: ANN001
    experts = fp8_experts(torch.float32, BLOCKS[0], kernels)
    up, down = experts.fp8["gate_up_proj"], experts.fp8["down_proj"]
    weights, ids = route(torch.randn(3, EXPERTS), 2, normalise=True)
    x = torch.randn(3, HIDDEN)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        kernels.fused_moe_fp8(x, up.weight, up.weight_scale_inv[:, :-1].contiguous(),
                              down.weight, down.weight_scale_inv, ids, weights, 16, 64)  # fmt: skip
    with pytest.raises(RuntimeError, match="codes must be contiguous float8_e4m3fn"):
        kernels.fused_moe_fp8(x, up.weight.float(), up.weight_scale_inv, down.weight,
                              down.weight_scale_inv, ids, weights, 16, 64)  # fmt: skip
    # each expert's gate and up rows share one grid: the intermediate size must be whole blocks
    with pytest.raises(InvalidArgument) as caught:
        FusedExperts(EXPERTS, HIDDEN, 24, torch.float32, False).quantize(
            Fp8Config(block=(16, 16)), "model.layers.0.mlp.experts", TPGroup()
        )
    assert caught.value.field == "quantization_config.weight_block_size"
    assert "model.layers.0.mlp.experts" in str(caught.value)
