"""The CPU kernel that runs a mixture of experts' routed experts in one call
(csrc/moe.cpp): against the per-token definition in float64, and bit for bit against the
torch path it replaces (model/moe.py, one GEMV or GEMM per expert hit from Python), over
1 to 1024 rows, top-1 to top-8, experts never hit and every token on one expert."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from hotswap.model.kernels import CpuKernels
from hotswap.model.moe import FusedExperts, route

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the engine runs on torch operators here",
)

HIDDEN, INTER, EXPERTS = 48, 24, 16


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = CpuKernels.load(progress=False)
    assert loaded is not None  # with a compiler present the build must succeed
    return loaded


def experts_of(dtype: torch.dtype, kernels: CpuKernels | None, seed: int = 0) -> FusedExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(EXPERTS, HIDDEN, INTER, dtype, invariant=False)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.2 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen))
        experts.down_proj.copy_(0.2 * torch.randn(EXPERTS, HIDDEN, INTER, generator=gen))
    # the torch path: the same kernels but the fused call, one product per expert hit
    experts.kernels = None if kernels is None else dataclasses.replace(kernels, fused_moe=None)
    return experts


def definition(experts: FusedExperts, x, ids, weights) -> torch.Tensor:  # noqa: ANN001
    """sum_j weights[t, j] * down[e] @ (silu(gate) * up)(gate_up[e] @ x[t]), e = ids[t, j],
    in float64, slot by slot over every token at once."""
    x = x.double()
    out = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        up = experts.gate_up_proj.double()[ids[:, j]]  # [tokens, 2 x inter, hidden]
        down = experts.down_proj.double()[ids[:, j]]
        gate, lin = torch.einsum("tnh,th->tn", up, x).chunk(2, dim=-1)
        hidden = torch.nn.functional.silu(gate) * lin
        out += weights[:, j, None].double() * torch.einsum("thi,ti->th", down, hidden)
    return out


def close_to_definition(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 to 1e-5; bf16 within its rounding: each product and the activation are
    rounded to bf16 (8 bits of mantissa) before they are summed, so the error is relative
    to the output's scale, not to each element."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    else:
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=2e-2 * scale, rtol=2e-2)


def step(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return route(torch.randn(tokens, EXPERTS, generator=gen), top_k, normalise=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 64, 1024])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_fused_experts_equal_the_definition_and_the_torch_path(
    kernels: CpuKernels, dtype: torch.dtype, tokens: int, top_k: int
) -> None:
    experts = experts_of(dtype, kernels)
    weights, ids = step(tokens, top_k, seed=tokens + top_k)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    assert got.dtype == dtype and got.shape == x.shape
    with torch.no_grad():
        assert torch.equal(got, experts(x, ids, weights))  # the products the torch path runs
    close_to_definition(got, definition(experts, x, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_for_every_token_and_experts_never_hit(kernels, dtype) -> None:  # noqa: ANN001
    experts = experts_of(dtype, kernels, seed=3)
    x = torch.randn(40, HIDDEN).to(dtype)
    ids = torch.full((40, 2), 5, dtype=torch.long)  # both slots of every token: expert 5
    ids[:, 1] = 11
    weights = torch.full((40, 2), 0.5)
    got = kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    with torch.no_grad():
        assert torch.equal(got, experts(x, ids, weights))
    close_to_definition(got, definition(experts, x, ids, weights))
    # an expert's weights that no token routes to are never read: NaN there changes nothing
    with torch.no_grad():
        experts.gate_up_proj[0].fill_(float("nan"))
        experts.down_proj[0].fill_(float("nan"))
    again = kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    assert torch.equal(again, got)


def test_each_token_sums_its_slots_in_slot_order(kernels) -> None:  # noqa: ANN001
    """Swapping a token's slots changes float32 rounding only: the kernel's order is the
    slots' own, so a token's result is the same whatever the batch around it (decode rows)."""
    experts = experts_of(torch.bfloat16, kernels, seed=4)
    weights, ids = step(6, 4, seed=9)
    x = torch.randn(6, HIDDEN).to(torch.bfloat16)
    batch = kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    for t in range(6):
        alone = kernels.fused_moe(x[t : t + 1], experts.gate_up_proj, experts.down_proj,
                                  ids[t : t + 1], weights[t : t + 1])  # fmt: skip
        assert torch.equal(alone[0], batch[t])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_of_another_ranks_experts_add_nothing(kernels, dtype) -> None:  # noqa: ANN001
    """Expert parallelism marks another rank's expert -1: its pairs are skipped, as if
    their weight were zero; a token with every slot elsewhere gets zeros."""
    experts = experts_of(dtype, kernels, seed=5)
    weights, ids = step(20, 4, seed=11)
    ids[ids >= EXPERTS // 2] = -1  # this rank holds experts 0-7
    ids[3] = -1
    x = torch.randn(20, HIDDEN).to(dtype)
    got = kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    with torch.no_grad():
        assert torch.equal(got, experts(x, ids, weights))  # the torch path skips them too
    kept = weights.masked_fill(ids < 0, 0.0)
    close_to_definition(got, definition(experts, x, ids.clamp(min=0), kept))
    assert not got[3].any()
    with pytest.raises(RuntimeError, match="or -1"):
        kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids - 1, weights)


def test_no_tokens_and_bad_inputs(kernels) -> None:  # noqa: ANN001
    experts = experts_of(torch.float32, kernels)
    up, down = experts.gate_up_proj, experts.down_proj
    weights, ids = step(3, 2, seed=0)
    x = torch.randn(3, HIDDEN)
    empty = kernels.fused_moe(x[:0], up, down, ids[:0], weights[:0])
    assert empty.shape == (0, HIDDEN)
    with pytest.raises(RuntimeError, match="expert id 16 is not below the number of experts"):
        kernels.fused_moe(x, up, down, torch.full_like(ids, EXPERTS), weights)
    with pytest.raises(RuntimeError, match="ids \\[tokens, top_k\\] int64"):
        kernels.fused_moe(x, up, down, ids.int(), weights)
    with pytest.raises(RuntimeError, match="weights \\[tokens, top_k\\] float32"):
        kernels.fused_moe(x, up, down, ids, weights.double())
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.fused_moe(x.bfloat16(), up, down, ids, weights)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernels.fused_moe(x[:, :-1], up, down, ids, weights)
