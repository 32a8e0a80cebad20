"""Rollout routing replay in the Python API: `CompletionOutput.routed_experts` holds the
top-k of transformers' router for every position fed to the model, for every sparse
layer; `routed_experts_prompt_start` skips prompt rows; a prefix-cache hit returns the
cached positions' experts; a dense model, or the flag off, returns None."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotswap import LLM, SamplingParams
from tests.helpers.moe import router_top_k
from tests.model.test_parity import PROMPTS

# Engines, one or more per test: slow.
pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


def reference_experts(model_dir, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """[positions, decoder layers, top_k]: the top-k of transformers' router probabilities
    (its router logits, one tensor per sparse layer) for `ids` fed as one sequence; a
    dense layer's rows are zero, as vLLM's and SGLang's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    return router_top_k(model, logits, len(ids))[1]


def engine(model_dir, **kw) -> LLM:  # noqa: ANN001
    return LLM(str(model_dir), dtype="float32", block_size=8, progress=False,
               enable_return_routed_experts=True, **kw)  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_experts_are_the_top_k_of_transformers_router(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    llm = engine(model_dir, max_num_batched_tokens=16)  # chunked prefill
    for out in llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False):
        comp = out.outputs[0]
        fed = out.prompt_token_ids + comp.token_ids[:-1]  # the last token was never fed
        got = comp.routed_experts
        assert got.dtype == np.uint8 and got.shape[0] == len(fed)
        np.testing.assert_array_equal(got, reference_experts(model_dir, fed))


def test_prompt_start_skips_prompt_rows_and_cache_hits_keep_theirs(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    llm = engine(model_dir)
    prompt = PROMPTS[4]
    first = llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0]
    full = first.outputs[0].routed_experts
    assert full.shape[1:] == (3, 2)  # every layer, top-2; layer 1 is dense: zero rows
    assert not full[:, 1].any() and full[:, [0, 2]].any()
    again = llm.generate(
        [prompt], SamplingParams(**GREEDY, routed_experts_prompt_start=5), use_tqdm=False
    )[0]
    assert again.num_cached_tokens > 0  # the cached positions' experts are still returned
    np.testing.assert_array_equal(again.outputs[0].routed_experts, full[5:])
    prompt_len = len(first.prompt_token_ids)
    whole = SamplingParams(**GREEDY, routed_experts_prompt_start=prompt_len)
    rows = llm.generate([prompt], whole, use_tqdm=False)[0].outputs[0].routed_experts
    np.testing.assert_array_equal(rows, full[prompt_len:])  # the output's rows only
    beyond = SamplingParams(**GREEDY, routed_experts_prompt_start=prompt_len + 1)
    with pytest.raises(ValueError, match=r"between 0 and the prompt length \(\d+\), inclusive"):
        llm.generate([prompt], beyond, use_tqdm=False)  # vLLM's check and message
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        SamplingParams(routed_experts_prompt_start=-1)


def test_dense_models_and_the_flag_off_return_none(tiny_model_factory) -> None:
    dense = engine(tiny_model_factory("llama"))
    out = dense.generate(["no experts here"], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].routed_experts is None
    off = LLM(str(tiny_model_factory("mixtral")), dtype="float32", progress=False)
    out = off.generate(["flag off"], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].routed_experts is None
