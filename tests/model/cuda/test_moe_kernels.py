"""The routed experts on the GPU path (model/cuda/moe_kernels.py): the grouping by expert
made on the device, and the fused experts against model/moe.py's torch path."""

from __future__ import annotations

import pytest
import torch

from hotswap.model.cuda.moe_kernels import MOE_BLOCK_M, group_by_expert
from hotswap.model.moe import FusedExperts, route
from tests.model.cuda.conftest import DEVICE, ops  # noqa: F401 - ops registers the kernels


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (7, 4, 2), (33, 64, 8)])
def test_grouping_puts_every_pair_once_in_its_experts_blocks(
    tokens: int, experts: int, top_k: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = route(torch.randn(tokens, experts, generator=gen), top_k, False)[1].to(DEVICE)
    pairs, block_experts = group_by_expert(ids, experts)
    num_pairs = tokens * top_k
    flat = ids.reshape(-1).cpu()
    real = pairs[pairs < num_pairs].cpu()
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    for block, expert in enumerate(block_experts.cpu().tolist()):
        rows = pairs[block * MOE_BLOCK_M : (block + 1) * MOE_BLOCK_M].cpu()
        rows = rows[rows < num_pairs]
        if expert < 0:
            assert rows.numel() == 0  # past the last group
        else:
            assert rows.numel() and (flat[rows] == expert).all()  # its expert's pairs only
    hit = flat.unique().numel()
    assert (
        int((block_experts >= 0).sum())
        == sum(-(-int((flat == e).sum()) // MOE_BLOCK_M) for e in range(experts))
        and hit <= experts
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (5, 8, 2), (40, 16, 4)])
def test_fused_experts_equal_the_torch_experts(
    dtype: torch.dtype, tokens: int, experts: int, top_k: int
) -> None:
    gen = torch.Generator().manual_seed(experts)
    reference = FusedExperts(experts, 64, 48, dtype, False)
    for param in (reference.gate_up_proj, reference.down_proj):
        param.data = (0.2 * torch.randn(param.shape, generator=gen)).to(dtype)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, True)
    want = reference(x, ids, weights).float()
    got = torch.ops.hotswap_gpu.fused_moe(
        x.to(DEVICE), reference.gate_up_proj.to(DEVICE), reference.down_proj.to(DEVICE),
        ids.to(DEVICE), weights.to(DEVICE),
    ).float().cpu()  # fmt: skip
    # bf16: the interpreter rounds each intermediate by truncation, a GPU to nearest
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    assert (got - want).abs().max() <= tolerance * want.abs().max()
