"""logprobs_mode and penalties against an independent reference: transformers' logits
processors (repetition penalty, temperature, min-p, top-k, top-p) on the same logits, in
vLLM's order, then log_softmax; presence/frequency penalties from their written (OpenAI)
definition. Engine-level cases compare with transformers' own forward pass in fp32."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hotswap import LLM, SamplingParams
from hotswap.engine.request import Request
from hotswap.execution.sampler import Sampler, SamplingBatch

_ids = itertools.count()

CASES = [
    SamplingParams(temperature=0.5, logprobs=3),
    SamplingParams(temperature=1.0, top_k=5, logprobs=3),
    SamplingParams(temperature=0.8, top_p=0.8, logprobs=3),
    SamplingParams(temperature=1.3, min_p=0.1, logprobs=3),
    SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logprobs=3,
    ),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=-0.4, logprobs=3),
]


def reference_logprobs(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """The distribution a token is drawn from, built from transformers' processors."""
    scores = logits.double()[None].clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([prompt + output])
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.numel())
    scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.temperature > 0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.min_p > 0:
            scores = MinPLogitsWarper(params.min_p)(None, scores)
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)[0]


def _request(params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    request = Request(f"r{next(_ids)}", prompt, params)
    for token in output:
        request.append_output_token(token)
    return request


@pytest.mark.parametrize("params", CASES, ids=range(len(CASES)))
def test_processed_logprob_is_the_log_probability_the_sampler_used(
    params: SamplingParams,
) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 64, 48
    logits = torch.randn(rows, vocab, generator=generator) * 3
    prompt, output = [1, 2, 3, 3, 9], [3, 7, 7, 7, 11]
    requests = [_request(params, prompt, output) for _ in range(rows)]
    sampler = Sampler(seed=5, logprobs_mode="processed_logprobs")
    out = sampler(logits.clone(), SamplingBatch.from_requests(requests))
    for row in range(rows):
        expected = reference_logprobs(logits[row], params, prompt, output)
        token, got = out.token_ids[row], out.logprobs[row]
        assert torch.isfinite(expected[token]), "sampled a token the reference masks"
        assert got.token_logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert got.token_rank == int((expected > expected[token]).sum()) + 1
        top = expected.topk(3)
        finite = int(torch.isfinite(top.values).sum())  # masked ties have no order
        assert got.top_ids[:finite] == top.indices.tolist()[:finite]
        assert got.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


def test_raw_modes_ignore_processing_and_processed_logits_are_masked() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0, logprobs=20)
    prompt, output = [4, 5], [6]

    def run(mode: str):  # noqa: ANN202
        requests = [_request(params, prompt, output) for _ in range(4)]
        return Sampler(seed=0, logprobs_mode=mode)(
            logits.clone(), SamplingBatch.from_requests(requests)
        )

    raw = run("raw_logprobs")
    raw_logits = run("raw_logits")
    processed = run("processed_logits")
    for row in range(4):
        as_dict = dict(zip(raw.logprobs[row].top_ids, raw.logprobs[row].top_logprobs))
        expected = torch.log_softmax(logits[row], dim=-1)
        assert [as_dict[t] for t in range(20)] == pytest.approx(expected.tolist(), abs=1e-5)
        as_dict = dict(zip(raw_logits.logprobs[row].top_ids, raw_logits.logprobs[row].top_logprobs))
        assert [as_dict[t] for t in range(20)] == pytest.approx(logits[row].tolist(), abs=1e-6)
        # processed logits: penalised, scaled by 1/T, all but the top 3 at -inf
        values = processed.logprobs[row].top_logprobs
        assert sum(v > float("-inf") for v in values) == 3
        reference = reference_logprobs(logits[row], params, prompt, output)
        finite = [v for v in values if v > float("-inf")]
        shifted = torch.log_softmax(torch.tensor(finite), dim=-1)
        assert shifted.tolist() == pytest.approx(reference.topk(3).values.tolist(), abs=1e-5)


def test_greedy_rows_report_processed_logits_at_temperature_one() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=0)
    requests = [_request(params, [1], [int(logits[r].argmax())]) for r in range(2)]
    out = Sampler(logprobs_mode="processed_logprobs")(
        logits.clone(), SamplingBatch.from_requests(requests)
    )
    for row in range(2):
        expected = reference_logprobs(logits[row], params, [1], requests[row].output_token_ids)
        assert out.token_ids[row] == int(expected.argmax())
        assert out.logprobs[row].token_logprob == pytest.approx(float(expected.max()), abs=1e-6)


def test_unknown_logprobs_mode_and_bad_penalties_are_refused(tiny_llama) -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(str(tiny_llama), logprobs_mode="processed", progress=False)
    bad = {
        "repetition_penalty": [0.0, -1.0, float("inf"), 101.0],
        "presence_penalty": [2.5, float("nan")],
        "frequency_penalty": [-3.0],
        "prompt_logprobs": [-1, 21],
    }
    for name, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: value})


# -- against transformers, end to end -------------------------------------------------------


def hf_logits(model_dir, sequences: list[list[int]]) -> list[torch.Tensor]:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


@pytest.fixture(scope="module")
def processed_llm(tiny_llama):
    return LLM(
        str(tiny_llama),
        dtype="float32",
        logprobs_mode="processed_logprobs",
        block_size=8,
        max_num_batched_tokens=16,
        progress=False,
    )


def test_engine_processed_logprobs_match_transformers(processed_llm, tiny_llama) -> None:
    prompt = list(range(10, 40))
    cases = [
        SamplingParams(**{**vars(p), "max_tokens": 12, "ignore_eos": True, "seed": i})
        for i, p in enumerate(CASES)
    ]
    outs = processed_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    sequences = [prompt + o.outputs[0].token_ids for o in outs]
    for params, out, logits in zip(cases, outs, hf_logits(tiny_llama, sequences)):
        tokens = out.outputs[0].token_ids
        for step, token in enumerate(tokens):
            expected = reference_logprobs(
                logits[len(prompt) + step - 1], params, prompt, tokens[:step]
            )
            got = out.outputs[0].logprobs[step][token]
            assert got.logprob == pytest.approx(float(expected[token]), abs=1e-4), (params, step)


def test_prompt_logprobs_match_transformers_chunked_and_after_a_prefix_hit(
    processed_llm, tiny_llama
) -> None:
    prompt = list(range(50, 90))  # 40 tokens: three chunks of at most 16
    (logits,) = hf_logits(tiny_llama, [prompt])
    expected = torch.log_softmax(logits, dim=-1)
    warm = SamplingParams(max_tokens=2, temperature=0.0)
    processed_llm.generate([prompt], warm, use_tqdm=False)  # now the prefix is cached
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    (out,) = processed_llm.generate([prompt], params, use_tqdm=False)
    assert out.num_cached_tokens == 0  # scored, not taken from the cache
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position, entries in enumerate(out.prompt_logprobs[1:]):
        token = prompt[position + 1]
        row = expected[position]
        assert entries[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entries[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(2)
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            assert entries[tid].logprob == pytest.approx(value, abs=1e-4)
            assert entries[tid].rank == rank + 1
    (again,) = processed_llm.generate([prompt], warm, use_tqdm=False)
    assert again.num_cached_tokens > 0  # requests without prompt logprobs still hit


def test_prompt_logprobs_with_n_choices_reach_every_output(processed_llm) -> None:
    params = SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=0, prompt_logprobs=0)
    (out,) = processed_llm.generate([list(range(5, 30))], params, use_tqdm=False)
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 25
    assert all(len(entries) == 1 for entries in out.prompt_logprobs[1:])


def test_repetition_penalty_greedy_matches_transformers_generate(tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    llm = LLM(str(tiny_llama), dtype="float32", progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    inputs = torch.tensor([prompt])
    seq = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        max_new_tokens=16,
        repetition_penalty=1.8,
        pad_token_id=0,
    )[0].tolist()
    assert out.outputs[0].token_ids == seq[len(prompt) :]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != out.outputs[0].token_ids  # the penalty mattered
