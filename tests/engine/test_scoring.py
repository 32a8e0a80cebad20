"""return_bf16_logprobs (engine/scoring.py): a finished request's sampled tokens scored by
the unquantized weights, checked against transformers on the checkpoint the engine was
given (its bf16/float32 weights, not the FP8 codes it serves)."""

from __future__ import annotations

import math

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.errors import InvalidArgument
from tests.model.test_fp8 import QUANTIZED

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8, 21, 40, 6, 1, 9]]


def hf_token_logprobs(model_dir, prompt: list[int], output: list[int]) -> list[float]:  # noqa: ANN001
    """Each output token's log-softmax under transformers' float32 forward of the whole
    sequence (the row before it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output)]


def make_llm(model_dir, fp8: bool, **kwargs) -> LLM:  # noqa: ANN001
    quantized = {"quantization": "fp8", "hf_overrides": QUANTIZED} if fp8 else {}
    return LLM(str(model_dir), dtype="float32", progress=False, block_size=8,
               enable_bf16_logprobs=True, **quantized, **kwargs)  # fmt: skip


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
def test_bf16_logprobs_equal_transformers_on_the_unquantized_weights(tiny_llama, fp8) -> None:
    llm = make_llm(tiny_llama, fp8, max_num_batched_tokens=8)  # the pass runs in chunks
    params = SamplingParams(max_tokens=12, seed=3, logprobs=0, ignore_eos=True,
                            return_bf16_logprobs=True)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    gaps = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        comp = out.outputs[0]
        want = hf_token_logprobs(tiny_llama, prompt, list(comp.token_ids))
        assert comp.bf16_logprobs == pytest.approx(want, abs=1e-4)
        sampled = [d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        gaps += [abs(a - b) for a, b in zip(sampled, comp.bf16_logprobs, strict=True)]
    # FP8 samples from another policy than the weights scored; float32 from the same one
    assert (max(gaps) > 1e-3) if fp8 else (max(gaps) < 1e-4)
    stats = llm.get_stats()
    assert stats["bf16_scored_tokens"] == 24
    assert stats["bf16_logprob_abs_diff_sum"] == pytest.approx(sum(gaps), abs=1e-6)
    # no block leaked, none of the pass's blocks joined the prefix cache
    assert stats["num_free_blocks"] == stats["num_blocks"]
    llm.shutdown()


def test_scoring_leaves_the_prefix_cache_alone(tiny_llama) -> None:
    llm = make_llm(tiny_llama, fp8=True)
    pool = llm.engine.scheduler.kv.pool
    plain = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPTS[1] * 3}], plain, use_tqdm=False)
    cached = dict(pool.cached)
    scored = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                            return_bf16_logprobs=True)  # fmt: skip
    out = llm.generate([{"prompt_token_ids": PROMPTS[1] * 3}], scored, use_tqdm=False)[0]
    assert len(out.outputs[0].bf16_logprobs) == 9
    assert out.num_cached_tokens > 0  # the FP8 prefix was reused by the request itself
    assert dict(pool.cached) == cached  # the bf16 pass registered nothing
    llm.shutdown()


def test_stop_strings_keep_the_tokens_they_end_with(tiny_llama) -> None:
    llm = make_llm(tiny_llama, fp8=True)
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    text = llm.generate([{"prompt_token_ids": PROMPTS[0]}], free, use_tqdm=False)[0].outputs[0]
    stop = text.text[len(text.text) // 2 :][:2]
    assert stop
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop],
                            return_bf16_logprobs=True)  # fmt: skip
    comp = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert len(comp.bf16_logprobs) == len(comp.token_ids) < 20
    want = hf_token_logprobs(tiny_llama, PROMPTS[0], list(comp.token_ids))
    assert comp.bf16_logprobs == pytest.approx(want, abs=1e-4)
    llm.shutdown()


def test_refused_without_the_engine_flag(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), progress=False)
    params = SamplingParams(max_tokens=2, return_bf16_logprobs=True)
    with pytest.raises(InvalidArgument) as caught:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert caught.value.field == "return_bf16_logprobs"
    assert llm.get_stats()["num_requests"] == 0
    llm.shutdown()


def test_not_a_boolean_is_refused() -> None:
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(return_bf16_logprobs="yes")
    assert caught.value.field == "return_bf16_logprobs"


def test_the_gap_counts_tis_clipping() -> None:
    from hotswap.engine.scoring import Bf16Gap

    gap = Bf16Gap()
    gap.record([-1.0, -2.0, math.nan], [-0.5, -1.0, -3.0])  # ratios e^0.5, e^1; nan skipped
    assert (gap.tokens, gap.clipped) == (2, 1)
    assert gap.abs_diff_sum == pytest.approx(1.5)


def test_a_short_kv_cache_preempts_and_loses_nothing(tiny_llama) -> None:
    llm = make_llm(tiny_llama, fp8=True, num_kv_blocks=8, max_model_len=64, max_num_seqs=4)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 50 + 3 for j in range(12)]} for i in range(4)]
    greedy = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    plain = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    params = SamplingParams(**greedy, return_bf16_logprobs=True)
    scored = llm.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, plain, scored, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        want = hf_token_logprobs(tiny_llama, prompt["prompt_token_ids"], a.outputs[0].token_ids)
        assert b.outputs[0].bf16_logprobs == pytest.approx(want, abs=1e-4)
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_preemptions"] > 0
    llm.shutdown()


@pytest.mark.slow
def test_two_tensor_parallel_ranks_score_on_their_shares(tiny_llama) -> None:
    llm = make_llm(tiny_llama, fp8=True, tensor_parallel_size=2)
    params = SamplingParams(max_tokens=8, seed=1, ignore_eos=True, return_bf16_logprobs=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = hf_token_logprobs(tiny_llama, prompt, list(out.outputs[0].token_ids))
        assert out.outputs[0].bf16_logprobs == pytest.approx(want, abs=1e-4)
    llm.shutdown()
