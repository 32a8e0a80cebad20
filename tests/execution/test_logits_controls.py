"""vLLM's logits controls in the sampler (logit_bias, allowed_token_ids, bad_words),
against their written definitions, and their interplay with min_tokens and stop."""

from __future__ import annotations

import itertools

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.engine.request import Request
from hotswap.execution.sampler import Sampler, SamplingBatch
from hotswap.sampling_params import resolve_bad_words

_ids = itertools.count()


def _request(params: SamplingParams, output: list[int]) -> Request:
    request = Request(f"r{next(_ids)}", [1, 2, 3], params, eos_token_id=0)
    for token in output:
        request.append_output_token(token)
    return request


def _processed(logits: torch.Tensor, params: SamplingParams, output: list[int]):  # noqa: ANN202
    params.logprobs = 20
    sampler = Sampler(seed=0, logprobs_mode="processed_logits")
    out = sampler(logits.clone()[None], SamplingBatch.from_requests([_request(params, output)]))
    entry = out.logprobs[0]
    values = torch.full((logits.numel(),), float("-inf"))
    values[entry.top_ids] = torch.tensor(entry.top_logprobs)
    return out.token_ids[0], values


def test_logit_bias_is_added_to_the_logits() -> None:
    logits = torch.randn(20, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, logit_bias={3: 50.0, 7: -2.5})
    token, values = _processed(logits, params, [])
    expected = logits.clone()
    expected[3] += 50.0
    expected[7] -= 2.5
    assert token == 3
    assert values.tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_allowed_token_ids_mask_everything_else() -> None:
    logits = torch.randn(20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[4, 9, 11])
    token, values = _processed(logits, params, [])
    assert token in (4, 9, 11)
    assert torch.isfinite(values).nonzero().flatten().tolist() == [4, 9, 11]
    assert values[[4, 9, 11]].tolist() == pytest.approx(logits[[4, 9, 11]].tolist(), abs=1e-6)


def test_bad_words_ban_the_last_token_once_the_prefix_is_generated() -> None:
    logits = torch.zeros(20)
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[5], [6, 7, 8]])
    params.bad_words = ["x"]
    _, fresh = _processed(logits, params, [1])
    assert fresh[5] == float("-inf") and torch.isfinite(fresh[8])  # 6 7 not generated yet
    _, after_prefix = _processed(logits, params, [1, 6, 7])
    assert after_prefix[5] == float("-inf") and after_prefix[8] == float("-inf")
    _, broken = _processed(logits, params, [6, 1, 7])
    assert torch.isfinite(broken[8])


def test_resolve_bad_words_tokenizes_as_vllm(tiny_llama) -> None:
    llm_tokenizer = LLM(str(tiny_llama), progress=False).tokenizer
    params = SamplingParams(bad_words=["fox", " quick"])
    resolve_bad_words(params, llm_tokenizer)
    encode = lambda text: llm_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode("fox") in params.bad_words_token_ids
    assert encode("quick") in params.bad_words_token_ids  # leading space stripped first
    spaced = encode(" fox")
    if spaced[0] != encode("fox")[0] and len(spaced) == len(encode("fox")):
        assert spaced in params.bad_words_token_ids


def test_min_tokens_bans_eos_even_when_allowed() -> None:
    logits = torch.full((20,), -5.0)
    logits[0] = 10.0  # EOS by far the likeliest
    params = SamplingParams(temperature=0.0, min_tokens=2, allowed_token_ids=[0, 4])
    token, _ = _processed(logits, params, [])
    assert token == 4


def test_engine_never_generates_banned_words_and_honours_bias(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", progress=False)
    prompt = list(range(20, 40))
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    first = free.outputs[0].token_ids[0]
    (banned,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=8, bad_words=[llm.tokenizer.decode([first])]),
        use_tqdm=False,
    )
    assert banned.outputs[0].token_ids[0] != first
    (biased,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=4, logit_bias={17: 100.0}, ignore_eos=True),
        use_tqdm=False,
    )
    assert biased.outputs[0].token_ids == [17] * 4
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.engine.scheduler.requests
