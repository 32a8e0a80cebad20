"""Mixture-of-experts models under tensor parallelism (two ranks) against one rank, in
float32: Qwen3-MoE (a dense layer among sparse ones), Qwen2-MoE (a gated shared expert),
Mixtral and OLMoE (q and k normalised whole) generate the same greedy tokens, logprobs
within 1e-5 and the same routed experts, through a chunked prefill. Weight rounds of
per-expert tensors, of transformers 5's stacked ones, and a disk reload give each rank
its fresh-load share (digest) and the tokens one rank generates on those weights. Sparse
deltas patch expert tensors where one slice of them holds this rank's share, and a
stacked gate_up_proj (two ranges) is refused naming it, changing nothing. An expert
width the ranks do not divide is refused, leaving no worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from hotswap.weight_transfer import diff_patches
from tests.engine.test_tensor_parallel import (
    PROMPTS,
    assert_same,
    make,
    refused_leaving_no_worker,
    run,
)
from tests.helpers.moe import stacked_experts
from tests.weight_transfer.test_bad_input import send
from tests.weight_transfer.test_sparse import trainer

# Two-rank engines (a worker process each) and one-rank references: slow.
pytestmark = pytest.mark.slow

TOKENS = SamplingParams(max_tokens=10, temperature=0)


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, TOKENS, use_tqdm=False)]


def digest(llm: LLM) -> str:
    return llm.get_weight_info()["digest"]


@pytest.mark.parametrize(
    "arch,overrides",
    [("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", {}), ("olmoe", {}),
     ("olmoe", {"num_key_value_heads": 1})],
    ids=["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "olmoe-kv1"],
)  # fmt: skip
def test_two_ranks_generate_and_route_what_one_does(
    tiny_model_factory,
    arch: str,
    overrides: dict,  # noqa: ANN001
) -> None:
    """OLMoE normalises q and k whole: the sums of squares meet across the ranks (its one
    key/value head replicated on both counted once)."""
    path = tiny_model_factory(arch, **overrides)
    single = run(make(path, 1, enable_return_routed_experts=True))
    llm = make(path, 2, enable_return_routed_experts=True)  # rank 0 records the routing
    try:
        parallel = run(llm)
        assert_same(single, parallel)  # the long prompt's prefill runs in chunks of 32
        for one, two in zip(single, parallel, strict=True):
            fed = len(one.prompt_token_ids) + len(one.outputs[0].token_ids) - 1
            want, got = one.outputs[0].routed_experts, two.outputs[0].routed_experts
            assert want is not None and want.shape[0] == fed
            np.testing.assert_array_equal(got, want)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_rounds_of_per_expert_or_stacked_tensors_reach_every_rank(
    tiny_model_factory,  # noqa: ANN001
    arch: str,
) -> None:
    v1, v2 = tiny_model_factory(arch, seed=0), tiny_model_factory(arch, seed=1)
    expected = {v1: tokens(make(v1, 1)), v2: tokens(make(v2, 1))}
    assert expected[v1] != expected[v2]
    llm = make(v1, 2, weight_transfer_config={"backend": "ipc"})
    try:
        fresh = digest(llm)
        send(llm, sorted(checkpoint(v2).items()))  # per-expert names
        assert tokens(llm) == expected[v2]
        updated = digest(llm)
        # transformers 5's stacked names: gate_up_proj written as its gate and up halves
        send(llm, sorted(stacked_experts(checkpoint(v1)).items()))
        assert digest(llm) == fresh  # every rank holds what a fresh load gave it
        assert tokens(llm) == expected[v1]
        send(llm, sorted(stacked_experts(checkpoint(v2)).items()))
        assert digest(llm) == updated
        llm.call("load_weights_from_disk", model_path=str(v1))
        assert digest(llm) == fresh
        assert tokens(llm) == expected[v1]
    finally:
        llm.shutdown()


def test_sparse_deltas_patch_expert_slices_and_refuse_a_stacked_gate_up(
    tiny_model_factory,  # noqa: ANN001
) -> None:
    path = tiny_model_factory("qwen3_moe")  # layers 0 and 2 sparse, 8 experts of 32
    before = stacked_experts(checkpoint(path))
    gate_up, down = (f"model.layers.0.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj"))
    up = "model.layers.2.mlp.experts.5.up_proj.weight"
    after = {down: before[down].clone(), up: checkpoint(path)[up].clone()}
    after[down][5, 7, [3, 20]] += 1.0  # a column on each rank
    after[up][[1, 30], 4] -= 0.5  # a row on each rank
    bad = before[gate_up].clone()
    bad[2, 40, 1] += 1.0
    llm = make(path, 2, weight_transfer_config={"backend": "sparse"})
    try:
        sender, start = trainer(llm), llm.get_weight_info()
        with pytest.raises(ValueError, match="per-expert") as refused:
            sender.send_patches(diff_patches({gate_up: before[gate_up]}, {gate_up: bad}), "no")
        assert gate_up in str(refused.value)
        assert llm.get_weight_info() == start
        changed = {down: before[down], up: checkpoint(path)[up]}
        sender.send_patches(diff_patches(changed, after), "patched")
        patched = digest(llm)
        assert patched != start["digest"]
        llm.load_weights_inline(after)  # the whole tensors: what the patches made already
        assert digest(llm) == patched
    finally:
        llm.shutdown()


def test_an_expert_width_the_ranks_do_not_divide_is_refused_and_leaves_no_worker(
    tiny_model_factory,  # noqa: ANN001
) -> None:
    path = tiny_model_factory("qwen3_moe", moe_intermediate_size=31)
    refused_leaving_no_worker(path, "divide the model's moe_intermediate_size")
