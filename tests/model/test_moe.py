"""Mixture-of-experts models: the routing and the grouped expert products against plain
references, prefix-cache hits and batch invariance against transformers and against the
same engine (parity without the cache: tests/model/test_parity.py)."""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.model.moe import FusedExperts, MoESpec, route
from tests.model.test_parity import PROMPTS, hf_reference, run_engine


def test_spec_reads_each_family_and_keeps_dense_layers_dense() -> None:
    qwen = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
            "norm_topk_prob": True, "mlp_only_layers": [0], "decoder_sparse_step": 2}  # fmt: skip
    spec = MoESpec.from_hf(qwen, num_layers=6)
    assert (spec.num_experts, spec.top_k, spec.intermediate_size) == (16, 4, 32)
    assert spec.sparse_layers == {1, 3, 5} and spec.norm_topk_prob
    mixtral = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64}
    spec = MoESpec.from_hf(mixtral, num_layers=2, mixtral=True)
    assert spec.norm_topk_prob and spec.sparse_layers == {0, 1} and spec.intermediate_size == 64
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoESpec.from_hf({**mixtral, "num_experts_per_tok": 9}, num_layers=2)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoESpec.from_hf({"num_experts": 8, "moe_intermediate_size": 8}, num_layers=2)


def test_route_is_softmax_then_top_k_optionally_renormalised() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = route(logits, 2, normalise=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = route(logits, 2, normalise=True)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))


def naive_experts(experts: FusedExperts, x, ids, weights):  # noqa: ANN001, ANN201
    """One token and one slot at a time: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("invariant", [False, True])
def test_grouped_experts_equal_the_per_token_definition(invariant: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    experts = FusedExperts(6, 16, 8, torch.float32, invariant)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=gen))
        experts.down_proj.copy_(torch.randn(6, 16, 8, generator=gen))
    x = torch.randn(11, 16, generator=gen)
    weights, ids = route(torch.randn(11, 6, generator=gen), 3, normalise=True)
    ids[0] = torch.tensor([5, 5 - 1, 0])  # experts hit by a single row, others by several
    with torch.no_grad():
        got = experts(x, ids, weights)
        torch.testing.assert_close(got, naive_experts(experts, x, ids, weights))
        if invariant:  # a row's result does not depend on the rows around it
            alone = torch.cat([experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1])
                               for i in range(11)])  # fmt: skip
            assert torch.equal(got, alone)


@pytest.mark.parametrize("invariant", [False, True])
def test_pairs_of_another_ranks_experts_add_nothing_on_the_torch_path(invariant: bool) -> None:
    """Expert parallelism marks another rank's expert -1; a step whose every pair is
    elsewhere (a decode step on the rank holding none of its experts) gives zeros."""
    gen = torch.Generator().manual_seed(1)
    experts = FusedExperts(4, 16, 8, torch.float32, invariant)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(4, 16, 16, generator=gen))
        experts.down_proj.copy_(torch.randn(4, 16, 8, generator=gen))
    x = torch.randn(5, 16, generator=gen)
    weights, ids = route(torch.randn(5, 8, generator=gen), 2, normalise=True)
    local = torch.where(ids < 4, ids, -1)  # this rank holds experts 0-3 of 8
    kept = weights.masked_fill(local < 0, 0.0)
    with torch.no_grad():
        got = experts(x, local, weights)
        torch.testing.assert_close(got, naive_experts(experts, x, local.clamp(min=0), kept))
        assert torch.equal(experts(x, torch.full_like(ids, -1), weights), torch.zeros(5, 16))


@pytest.mark.slow  # engines
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_prefix_cache_hits_match_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm, first, _ = run_engine(model_dir, PROMPTS, 12, block_size=8)
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert sum(out.num_cached_tokens for out in again) > 0
    expected, _ = hf_reference(model_dir, [o.prompt_token_ids for o in again], 12)
    for out, tokens in zip(again, expected):
        assert out.outputs[0].token_ids == tokens, out.prompt


@pytest.mark.slow  # an engine
def test_batch_invariant_engine_gives_each_prompt_the_same_bits_alone_or_batched(
    tiny_model_factory,
) -> None:
    llm = LLM(str(tiny_model_factory("qwen2_moe")), dtype="float32", batch_invariant=True,
              block_size=8, progress=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, batched in zip(PROMPTS, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == batched.outputs[0].token_ids
        assert alone.logprobs == batched.outputs[0].logprobs
